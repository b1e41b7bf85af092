"""The Fabric path's step time against the Trainer path's, where the step is framework time (a tiny MLP).

    python benchmarks/fabric_overhead.py [--steps 600] [--rounds 5] [--record]

The model, data, optimizer (AdamW) and step-interval LambdaLR of benchmarks/framework_overhead.py, with
``MixedPrecisionPlugin("bf16-mixed")`` (every step's gradients checked, a non-finite step skipped) driven by a
``Trainer`` and by a Fabric loop written as users write it (``model(x)``, loss, ``fabric.backward``,
``optimizer.step()``, ``zero_grad``, ``scheduler.step()``); Fabric's own ``precision="bf16-mixed"`` for reference.
One process, one thread, the modes alternating round by round; each round times the steps only (the first batch's
start to the last batch's end: no setup), the first round warms up and is not counted; the table gives the median
over the other rounds of the mean time per step.
"""

from __future__ import annotations

import argparse
import time
import warnings

import lightning as L
import torch
from _report import QUIET_TRAINER, report, rounds_table
from framework_overhead import _MLP
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin

MODES = ("trainer+ours", "fabric+ours", "fabric+builtin-bf16")


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.start = self.end = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.end = time.perf_counter()


def _data(steps: int) -> DataLoader:
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32 * steps, 16), torch.randint(0, 10, (32 * steps,))), batch_size=32)


def _trainer_ms(steps: int) -> float:
    timer = _StepTimer()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        **QUIET_TRAINER,
        plugins=[MixedPrecisionPlugin("bf16-mixed")],
        callbacks=[timer],
    )
    trainer.fit(_MLP(), _data(steps))
    return (timer.end - timer.start) / (steps - 1) * 1e3  # from the first batch's start: steps - 1 whole steps


def _fabric_ms(steps: int, builtin: bool) -> float:
    precision = {"precision": "bf16-mixed"} if builtin else {"plugins": [MixedPrecisionPlugin("bf16-mixed")]}
    fabric = L.Fabric(accelerator="cpu", devices=1, **precision)
    model = _MLP().net
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(_data(steps))
    start = end = 0.0
    for index, (inputs, labels) in enumerate(loader):
        if index == 0:
            start = time.perf_counter()
        loss = nn.functional.cross_entropy(model(inputs), labels)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        end = time.perf_counter()
    return (end - start) / (steps - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        times["trainer+ours"].append(_trainer_ms(args.steps))
        times["fabric+ours"].append(_fabric_ms(args.steps, builtin=False))
        times["fabric+builtin-bf16"].append(_fabric_ms(args.steps, builtin=True))
    title = f"Fabric vs Trainer step time, 16-64-64-10 MLP, AdamW, {args.steps} steps x {args.rounds} rounds"
    report(title, rounds_table(times, "trainer+ours", "time"), "cpu", args.record)


if __name__ == "__main__":
    main()
