"""Subclass MixedPrecisionPlugin to change one behaviour without forking it.

    python examples/subclass_plugin.py

`LoggingPlugin` reports every skipped step with the parameters whose gradients overflowed, and refuses to go
on after too many skips in a row. Everything else (scaling, unscaling, clipping, checkpoints) is inherited.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin


class LoggingPlugin(MixedPrecisionPlugin):
    """Prints each skipped step and stops after `max_consecutive_skips` skips in a row."""

    def __init__(self, *args: Any, max_consecutive_skips: int = 5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_consecutive_skips = max_consecutive_skips
        self.consecutive_skips = 0
        self.skip_log: list[tuple[int, float, list[str]]] = []

    def optimizer_step(
        self, optimizer: Any, model: L.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        skipped_before = self.scaler.skipped_steps
        scale_before = self.scaler.scale
        names = []

        def closure_that_records() -> Any:
            result = closure()
            # after backward: which gradients are non-finite (only worth the sync when we print them)
            names[:] = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
            return result

        output = super().optimizer_step(optimizer, model, closure_that_records, **kwargs)
        if self.scaler.skipped_steps > skipped_before:
            self.consecutive_skips += 1
            self.skip_log.append((model.trainer.global_step, scale_before, names))
            print(f"step {model.trainer.global_step}: skipped at scale {scale_before:g}, non-finite grads in {names}")
            if self.consecutive_skips > self.max_consecutive_skips:
                raise RuntimeError(f"{self.consecutive_skips} skipped steps in a row: stopping")
        else:
            self.consecutive_skips = 0
        return output


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=3)
    args = parser.parse_args()
    L.seed_everything(0)
    x = torch.randn(512, 8)
    y = x.sum(dim=1, keepdim=True) * 1000.0  # large targets: the first steps overflow at scale 2**16
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    plugin = LoggingPlugin("16-mixed", scaler=DynamicLossScaler(init_scale=2.0**16), max_consecutive_skips=20)
    trainer = L.Trainer(
        plugins=[plugin],
        max_epochs=args.max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), loader)
    print(f"{len(plugin.skip_log)} skipped steps; final scale {plugin.scaler.scale:g}")


if __name__ == "__main__":
    main()
