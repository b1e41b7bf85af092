"""Training code that writes the model during fit, as written for an fp32 model (tests/test_training_writes.py and
tests/distributed/write_checks.py).

:class:`BufferWriter` writes floating buffers the ways real projects do: anomalib registers its anomaly threshold and
score range as NaN buffers and fills them in place at each validation epoch end (here: the module's hook and a
callback); a running value written in place at every training step; one element of a buffer written, the others left
as they were; a buffer assigned a new tensor. Every written value is exact in bf16 and fp16, so the reference is the
values themselves (what an fp32 model holds): after fit, in the model and in every checkpoint, each buffer must hold
them bitwise, and the elements nothing wrote their exact fp32 values from before setup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import make_trainer

#: the values each buffer holds after fit (exact: fp32 values never representable in 16 bits where nothing wrote)
EXPECTED_BUFFERS = {
    "threshold": torch.tensor(0.625),
    "score_range": torch.tensor([-1.0, 2.0]),
    "running": torch.tensor([2.0, 4.0, 6.0]),
    "partly": torch.tensor([0.1, 0.75, 0.3]),
    "assigned": torch.tensor([0.1, 1.5]),
}


def batches(count: int = 2) -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(4 * count, 4, generator=generator), torch.randn(4 * count, 2, generator=generator))
    return DataLoader(data, batch_size=4)


class BufferWriter(L.LightningModule):
    """A small regressor with the buffers of the module doc; two batches an epoch, validation every epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.register_buffer("threshold", torch.tensor(float("nan")))
        self.register_buffer("score_range", torch.full((2,), float("nan")))
        self.register_buffer("running", torch.zeros(3))
        self.register_buffer("partly", torch.tensor([0.1, 0.2, 0.3]))
        self.register_buffer("assigned", torch.zeros(2))
        self.checkpoints: list[dict[str, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        self.running.copy_(torch.tensor([1.0, 2.0, 3.0]) * (batch_idx + 1))
        self.partly[1:2].copy_(torch.tensor([0.75]))
        return nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.net(batch[0])

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.threshold.copy_(torch.tensor(0.625))  # anomalib: self._image_threshold.copy_(...)
        self.assigned = torch.tensor([0.1, 1.5])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class WriteScoreRange(L.Callback):
    """anomalib's normalisation callbacks write the score range in place at the validation epoch end."""

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            pl_module.score_range.copy_(torch.tensor([-1.0, 2.0]))


class KeepCheckpoints(L.Callback):
    """Saves a checkpoint after every validation epoch (as ModelCheckpoint does) and keeps its buffers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        path = self.directory / f"epoch{trainer.current_epoch}.ckpt"  # written by rank 0, read by every rank
        trainer.save_checkpoint(path)
        state = torch.load(path, weights_only=True)["state_dict"]
        pl_module.checkpoints.append({name: state[name] for name in EXPECTED_BUFFERS})


def fit_buffer_writer(plugins: list[Any], directory: Path, **trainer_kwargs: Any) -> BufferWriter:
    """Two epochs of :class:`BufferWriter` with the writing callback and a checkpoint after each validation;
    ``plugins``: none (Lightning's built-in ``bf16-mixed``) or one plugin."""
    torch.manual_seed(0)
    module = BufferWriter()
    precision = {} if plugins else {"precision": "bf16-mixed"}
    trainer = make_trainer(
        plugins[0] if plugins else None,
        max_epochs=2,
        num_sanity_val_steps=0,
        callbacks=[WriteScoreRange(), KeepCheckpoints(directory)],
        **precision,
        **trainer_kwargs,
    )
    trainer.fit(module, batches(2 * trainer_kwargs.get("devices", 1)), batches(1))
    return module


def buffers_of(module: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in module.named_buffers() if name in EXPECTED_BUFFERS}
