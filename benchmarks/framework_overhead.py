"""What the plugin's per-step work costs where nothing else does: a tiny MLP whose step is framework time.

    python benchmarks/framework_overhead.py [--steps 600] [--rounds 5] [--clock wall|cpu]
        [--master-weights none|fp32|remainder] [--record]

Lightning's built-in ``bf16-mixed`` against ``MixedPrecisionPlugin("bf16-mixed")`` (the default: every step's
gradients checked for inf/NaN, a non-finite step skipped) and against the plugin with ``scaler={"enabled": False}``
(no check: what the built-in does). One process, one thread, the modes alternating round by round, each round a
fresh Trainer fitting ``--steps`` steps of a 16-64-64-10 MLP with AdamW and a step-interval LambdaLR (batch 32).
The first round warms up and is not counted; the table gives the median over the other rounds of the mean
wall-clock time per step. ``--master-weights fp32|remainder`` gives the plugin's modes master weights (the
built-in stays as it is): what the masters' per-step work, the check of writes into the model included, costs. ``--clock cpu`` times this process's CPU time instead (``time.process_time``): on a machine
shared with other jobs, waiting for a core then does not count (with one thread, both clocks agree on an idle one).
"""

from __future__ import annotations

import argparse
import time
import warnings
from typing import Callable

import lightning as L
import torch
from _report import QUIET_TRAINER, report, rounds_table
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin

MODES = ("builtin-bf16", "ours-bf16", "ours-bf16 without check")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _MLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        return nn.functional.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), 1e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


MASTER_WEIGHTS = {"none": False, "fp32": True, "remainder": "remainder"}


def _ms_per_step(
    mode: str, steps: int, clock: Callable[[], float] = time.perf_counter, master_weights: str = "none"
) -> float:
    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32 * steps, 16), torch.randint(0, 10, (32 * steps,))), batch_size=32)
    if mode == "builtin-bf16":
        precision = {"precision": "bf16-mixed"}
    else:
        scaler = {"enabled": False} if mode.endswith("without check") else None
        masters = MASTER_WEIGHTS[master_weights]
        precision = {"plugins": [MixedPrecisionPlugin("bf16-mixed", scaler=scaler, master_weights=masters)]}
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, **QUIET_TRAINER, **precision)
    start = clock()
    trainer.fit(_MLP(), data)
    return (clock() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--master-weights", choices=tuple(MASTER_WEIGHTS), default="none")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(_ms_per_step(mode, args.steps, CLOCKS[args.clock], args.master_weights))
    title = f"Framework overhead per step, 16-64-64-10 MLP, AdamW, {args.steps} steps x {args.rounds} rounds"
    title += ", CPU time" if args.clock == "cpu" else ""
    title += (
        f", plugin with master_weights={MASTER_WEIGHTS[args.master_weights]!r}" if args.master_weights != "none" else ""
    )
    report(title, rounds_table(times, "builtin-bf16", "speed"), "cpu", args.record)


if __name__ == "__main__":
    main()
