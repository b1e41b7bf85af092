"""Tiny fp16 models with an inf/NaN planted in a known module at a known optimizer step, for the diagnostics tests."""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
import torch
import torchmetrics
from torch import nn

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, PrecisionMonitor
from tests.helpers import make_trainer, regression_loader


class Planted(nn.Module):
    """Identity, except at optimizer step ``at`` (and micro-batch ``batch_idx`` if given), where ``how`` acts:

    - ``"forward"``: multiplies its output by 1e5 (an fp16 overflow for inputs above 0.66);
    - ``"backward"``: a hook on its output multiplies the incoming gradient by 1e5 (1e5 is inf in fp16);
    - ``"log"``: returns ``log(x - 10)``, NaN for every input below 10, in any precision.
    """

    def __init__(self, how: str, at: int, batch_idx: Optional[int] = None) -> None:
        super().__init__()
        self.how, self.at, self.batch_idx = how, at, batch_idx
        self.step: Callable[[], tuple[int, int]] = lambda: (-1, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step, batch_idx = self.step()
        if step != self.at or (self.batch_idx is not None and batch_idx != self.batch_idx):
            return x
        if self.how == "forward":
            return x * 1e5
        if self.how == "log":
            return torch.log(x - 10.0)
        x = x * 1.0
        if x.requires_grad:
            x.register_hook(lambda grad: grad * 1e5)
        return x


class PlantedModel(L.LightningModule):
    """Linear(4, 8) [BatchNorm] Tanh [Dropout] Planted Linear(8, 1), MSE, Adam; logs ``train_loss`` and keeps
    its running mean in a torchmetrics ``MeanMetric``."""

    def __init__(
        self, planted: Optional[Planted] = None, manual: bool = False, dropout: float = 0.0, batchnorm: bool = False
    ) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        planted = planted or Planted("none", at=-1)
        layers: list[nn.Module] = [nn.Linear(4, 8)]
        layers += [nn.BatchNorm1d(8)] if batchnorm else []
        layers += [nn.Tanh(), nn.Dropout(dropout), planted, nn.Linear(8, 1)]
        self.net = nn.Sequential(*layers)
        self.batch_idx = -1
        self.loss_mean = torchmetrics.MeanMetric()  # a metric state the overflow replay must leave alone
        planted.step = lambda: (self.trainer.global_step, self.batch_idx)

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        self.batch_idx = batch_idx
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.loss_mean.update(loss.detach())
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return None

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit_planted(
    model: L.LightningModule,
    monitor: Optional[PrecisionMonitor] = None,
    steps: int = 4,
    init_scale: float = 1024.0,
    master_weights: bool = False,
    precision: str = "16-mixed",
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, PrecisionMonitor]:
    """Fit ``model`` for ``steps`` optimizer steps in fp16 (CPU) with a PrecisionMonitor (no report by default)."""
    torch.manual_seed(0)
    monitor = monitor if monitor is not None else PrecisionMonitor(sample_every=0, report=False)
    scaler = DynamicLossScaler(init_scale=init_scale) if precision == "16-mixed" else None
    plugin = MixedPrecisionPlugin(precision, scaler=scaler, master_weights=master_weights)
    trainer = make_trainer(plugin, callbacks=[monitor], max_steps=steps, **trainer_kwargs)
    trainer.fit(model, regression_loader(n=64, batch_size=8))
    return trainer, monitor
