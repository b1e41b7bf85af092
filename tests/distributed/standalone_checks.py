"""2-rank DDP under both Lightning packages (run by tests/test_standalone_packages.py through launch.py).

    python tests/distributed/standalone_checks.py OUT

Each mode of ``DDP_MODES`` is fitted twice on the same process group, with ``lightning.Trainer(strategy="ddp")`` and
with ``pytorch_lightning.Trainer(strategy="ddp")`` (the plugin from ``lightning_mp.pytorch_lightning``); each rank
saves its final weights, learning rates and skipped steps per package to OUT/rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.distributed.common import finish, save
from tests.test_standalone_packages import MODES, fit, weights

DDP_MODES = ("bf16-masters", "clip-norm-remainder")


def main() -> None:
    out = Path(sys.argv[1])
    results, rank = {}, 0
    for name in DDP_MODES:
        for package in ("lightning", "pytorch_lightning"):
            model, plugin, trainer = fit(package, MODES[name], strategy="ddp", devices=2)
            rank = trainer.global_rank
            results[name, package] = {
                "weights": weights(model),
                "lrs": model.lrs,
                "skipped": plugin.scaler.skipped_steps,
                "sync": type(plugin.steps.sync).__name__,
                "world_size": trainer.world_size,
            }
            torch.distributed.barrier()
    save(results, out, rank)
    finish()


if __name__ == "__main__":
    main()
