"""The diagnosis corpus: third-party models x planted faults, each run as a user runs it (a Trainer with the
MixedPrecisionPlugin in fp16 and a PrecisionMonitor), and what the monitor said about each.

Models (tiny configs, CPU): HF GPT-2 and Llama (causal masks inside), HF BERT with a padding mask, each with
transformers' default attention (``sdpa``) and GPT-2 and BERT also with ``eager`` attention (the additive
``finfo.min`` masks and the softmax in plain sight); ``nn.TransformerEncoder`` with a causal mask of ``-inf`` and
one of ``finfo(float16).min``; Lightning's demo ``Transformer`` (``nn.Transformer`` with ``-inf`` masks); a CNN.
Plants:

- ``init_scale``: no fault, ``init_scale=2**24``: the scaled gradients overflow fp16 in backward -> ``loss_scale``;
- ``forward``: at step 1 the target module's output is rescaled so that its largest magnitude is 1e5 (a multiply
  by ``1e5 / amax``; above fp16's 65504, fine in fp32) -> ``half_precision`` in that module, forward, op ``mul``;
- ``backward``: at step 1 a hook on the target module's output does the same to its gradient -> ``half_precision``
  in that module, backward, op ``mul``;
- ``sqrt``: at step 1 the target module returns ``sqrt(output - amax - 1)`` (the square root of negatives: NaN in
  any precision) -> ``model`` in that module, forward, op ``sqrt``.

``python -m tests.corpus`` prints the table (model x plant -> cause, module, phase, op).
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, PrecisionMonitor
from lightning_mp.diagnostics import advise
from tests.helpers import make_trainer

PLANT_AT = 1  # the optimizer step the module plants act at (step 0 runs clean)
VOCAB, SEQ, BATCH, WIDTH = 32, 8, 2, 16
MODELS = ("gpt2", "gpt2_eager", "llama", "bert", "bert_eager", "encoder_inf", "encoder_min", "demo", "cnn")
PLANTS = ("init_scale", "forward", "backward", "sqrt")
EXPECTED = {  # plant -> (cause, phase, op); the module plants name their target module
    "init_scale": ("loss_scale", "backward", None),
    "forward": ("half_precision", "forward", "mul"),
    "backward": ("half_precision", "backward", "mul"),
    "sqrt": ("model", "forward", "sqrt"),
}


def _hf(name: str) -> tuple[nn.Module, str]:
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=WIDTH, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(config), "model.transformer.h.0.mlp"
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=WIDTH,
            intermediate_size=2 * WIDTH,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
        )
        return transformers.LlamaForCausalLM(config), "model.model.layers.0.mlp"
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=2 * WIDTH,
        max_position_embeddings=SEQ,
        num_labels=2,
    )
    return transformers.BertForSequenceClassification(config), "model.bert.encoder.layer.0.output.dense"


class _Encoder(nn.Module):
    """Embedding -> nn.TransformerEncoder (2 layers, causal float mask) -> Linear head."""

    def __init__(self, mask_value: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=2, dim_feedforward=2 * WIDTH, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.mask_value = mask_value

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.full((ids.shape[1], ids.shape[1]), self.mask_value, device=ids.device).triu(1)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))


def build(name: str) -> tuple[nn.Module, str, Callable[[nn.Module, Any], torch.Tensor], Any]:
    """(model, qualified name of the plant's target inside CorpusModule, loss function, one batch)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    if name.endswith("_eager"):
        model, target, loss, batch = build(name.removesuffix("_eager"))
        model.config._attn_implementation = "eager"  # the additive masks and the softmax in plain sight
        return model, target, loss, batch
    if name in ("gpt2", "llama"):
        model, target = _hf(name)
        return model, target, lambda m, b: m(input_ids=b[0], labels=b[0]).loss, (ids,)
    if name == "bert":
        model, target = _hf(name)
        attention = torch.ones(BATCH, SEQ, dtype=torch.long)
        attention[0, SEQ // 2 :] = 0  # padding: the first sample's second half is masked out
        labels = torch.tensor([0, 1])
        return (
            model,
            target,
            lambda m, b: m(input_ids=b[0], attention_mask=b[1], labels=b[2]).loss,
            (ids, attention, labels),
        )
    if name.startswith("encoder"):
        model = _Encoder(-math.inf if name == "encoder_inf" else torch.finfo(torch.float16).min)
        loss = lambda m, b: nn.functional.cross_entropy(m(b[0]).float().flatten(0, 1), b[0].flatten())  # noqa: E731
        return model, "model.encoder.layers.0.linear2", loss, (ids,)
    if name == "demo":
        from lightning.pytorch.demos import Transformer

        model = Transformer(vocab_size=VOCAB, ninp=WIDTH, nhead=2, nhid=2 * WIDTH, nlayers=1, dropout=0.0)
        loss = lambda m, b: nn.functional.nll_loss(m(b[0], b[0]).float(), b[0].view(-1))  # noqa: E731
        return model, "model.transformer.encoder.layers.0.linear2", loss, (ids,)
    images = torch.randn(BATCH, 3, 8, 8, generator=gen)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )
    return (
        model,
        "model.2",
        lambda m, b: nn.functional.cross_entropy(m(b[0]).float(), b[1]),
        (images, torch.tensor([1, 7])),
    )


class CorpusModule(L.LightningModule):
    def __init__(self, name: str, plant: str) -> None:
        super().__init__()
        self.model, self.target, self.loss_fn, self.batch = build(name)
        self.plant = plant
        if plant in ("forward", "backward", "sqrt"):
            self.get_submodule(self.target).register_forward_hook(self._planted)

    def _planted(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.trainer.global_step != PLANT_AT:
            return None
        first = output[0] if isinstance(output, tuple) else output
        amax = first.detach().abs().amax().clamp_min(1e-6)
        if self.plant == "forward":
            planted = first / amax * 1e5
        elif self.plant == "sqrt":
            planted = torch.sqrt(first - amax - 1.0)
        else:
            planted = first * 1.0
            planted.register_hook(lambda grad: grad / grad.abs().amax().clamp_min(1e-6) * 1e5)
        return (planted, *output[1:]) if isinstance(output, tuple) else planted

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self.batch), batch_size=BATCH)  # one batch per epoch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss_fn(self.model, batch)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def run(name: str, plant: str, master_weights: bool = False) -> tuple[CorpusModule, PrecisionMonitor]:
    """Fit one cell: 3 steps for ``init_scale`` (every one skipped), else 2 (step 1 planted)."""
    torch.manual_seed(0)
    model = CorpusModule(name, plant)
    monitor = PrecisionMonitor(sample_every=0, report=False)
    scaler = DynamicLossScaler(init_scale=2.0**24 if plant == "init_scale" else 2.0**10)
    trainer = make_trainer(
        MixedPrecisionPlugin("16-mixed", scaler=scaler, master_weights=master_weights),
        callbacks=[monitor],
        max_steps=3 if plant == "init_scale" else 2,
        max_epochs=-1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return model, monitor


def table(models: tuple[str, ...] = MODELS, master_weights: bool = False) -> str:
    lines = ["| model | plant | cause | module | phase | op | advice | seconds |", "|---|---|---|---|---|---|---|---:|"]
    for name in models:
        for plant in PLANTS:
            start = time.perf_counter()
            model, monitor = run(name, plant, master_weights)
            record = monitor.history.overflows[-1] if monitor.history.overflows else None
            rules = ",".join(a.rule for a in advise(monitor.history))
            where = (record.cause, record.module or "-", record.phase, record.op) if record else ("-",) * 4
            lines.append(
                f"| {name} | {plant} | " + " | ".join(where) + f" | {rules or '-'} | "
                f"{time.perf_counter() - start:.1f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(table(master_weights="--masters" in sys.argv))
