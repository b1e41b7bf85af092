"""``PrecisionMonitor``: loss scale, skipped steps and learning rate in the progress bar and the logger."""

from __future__ import annotations

from typing import Any

import lightning as L
from typing_extensions import override


class PrecisionMonitor(L.Callback):
    """Logs ``loss_scale`` and ``skipped_steps`` (when the precision plugin has a scaler) and ``lr`` (the first
    param group of each optimizer: ``lr``, ``lr-1``, ...) after every training batch.

    Args:
        prog_bar: also show the scale and the skipped steps in the progress bar (default ``True``).
    """

    def __init__(self, prog_bar: bool = True) -> None:
        self.prog_bar = prog_bar

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        scaler = getattr(trainer, "scaler", None)
        if scaler is not None and hasattr(scaler, "skipped_steps") and getattr(scaler, "enabled", True):
            pl_module.log("loss_scale", float(scaler.scale), prog_bar=self.prog_bar, on_step=True, on_epoch=False)
            pl_module.log(
                "skipped_steps", float(scaler.skipped_steps), prog_bar=self.prog_bar, on_step=True, on_epoch=False
            )
        for index, optimizer in enumerate(trainer.optimizers):
            name = "lr" if index == 0 else f"lr-{index}"
            pl_module.log(name, float(optimizer.param_groups[0]["lr"]), on_step=True, on_epoch=False)
