"""Tiny stand-ins for the names the documentation's code blocks use without defining them.

The docs write ``trainer.fit(model, datamodule)`` for "your LightningModule and your data"; the tests run those
blocks with a small classifier on random data (CPU, real fp16 where the block asks for it), so every snippet runs in
well under a second. ``tests/test_docs_code.py`` gives each block a fresh set of these.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES, SAMPLES, BATCH = 16, 2, 64, 8


class TinyClassifier(L.LightningModule):
    """An encoder (Linear, LayerNorm, GELU, Linear) and a ``classifier`` head; AdamW; cross-entropy in fp32."""

    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.lr = lr
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32))
        self.classifier = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x).float(), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class TinyDataModule(L.LightningDataModule):
    """Random features whose label is the sign of their sum: 64 training and 16 validation examples."""

    def setup(self, stage: str) -> None:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES + 16, FEATURES, generator=generator)
        y = (x.sum(dim=1) > 0).long()
        self.train_set = TensorDataset(x[:SAMPLES], y[:SAMPLES])
        self.val_set = TensorDataset(x[SAMPLES:], y[SAMPLES:])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=BATCH)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=BATCH)


def standins() -> dict[str, Any]:
    """Fresh globals for one code block: ``model``, ``datamodule``, ``batch`` (and its ``x``), ``optimizer``."""
    torch.manual_seed(0)
    model = TinyClassifier()
    x = torch.randn(BATCH, FEATURES)
    batch = (x, (x.sum(dim=1) > 0).long())
    return {
        "model": model,
        "datamodule": TinyDataModule(),
        "batch": batch,
        "x": x,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }


#: Trainer arguments the docs' blocks leave out and the tests set: a few steps, quiet, inside a temporary folder.
TRAINER_DEFAULTS: dict[str, Any] = {
    "max_steps": 3,
    "limit_val_batches": 1,
    "num_sanity_val_steps": 0,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}
