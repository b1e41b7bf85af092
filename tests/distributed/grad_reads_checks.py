"""2-rank DDP checks of the gradients user code reads in the Trainer's hooks (run by tests/test_observable_grads.py).

    python tests/distributed/grad_reads_checks.py OUT

Lightning's built-in ``bf16-mixed`` and the plugin with each master mode, under ``strategy="ddp"``: a gradient-norm
logger written the usual guarded way (``if p.grad is not None``) in ``on_before_optimizer_step`` and in
``on_train_batch_end``, 4 steps, the same data split over the ranks. Each rank saves what each mode's hooks read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from tests.distributed.common import finish, save, sum_loader
from tests.helpers import make_trainer

MODES: dict[str, Optional[dict[str, Any]]] = {
    "builtin": None,
    "no masters": {},
    "True": {"master_weights": True},
    "remainder": {"master_weights": "remainder"},
}


class NormLogger(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.read: dict[str, list[list[Optional[float]]]] = {"before_step": [], "batch_end": []}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def _norms(self) -> list[Optional[float]]:
        return [float(p.grad.float().norm()) if p.grad is not None else None for p in self.parameters()]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.read["before_step"].append(self._norms())

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.read["batch_end"].append(self._norms())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self) -> Any:
        return sum_loader(self.trainer.world_size, self.global_rank)


def main(out: Path) -> None:
    results: dict[str, Any] = {}
    rank = 0
    for name, options in MODES.items():
        torch.manual_seed(0)  # the same model on every rank and in every mode
        module = NormLogger()
        plugin = None if options is None else MixedPrecisionPlugin("bf16-mixed", **options)
        precision = {"precision": "bf16-mixed"} if plugin is None else {}
        trainer = make_trainer(plugin, devices=2, strategy="ddp", max_steps=4, max_epochs=None, **precision)
        trainer.fit(module)
        rank = trainer.global_rank
        results[name] = module.read
    save(results, out, rank)
    finish()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
