"""A Trainer step whose cost is the optimizer's: lean masters against Lightning's built-in bf16-mixed.

    python benchmarks/step_alone.py [--tensors 32] [--numel 524288] [--steps 30] [--rounds 5] [--device cpu] [--record]

The LightningModule is only ``--tensors`` parameter tensors of ``--numel`` values each (16.8M by default) and its
loss is one elementwise pass, ``sum((p * c).sum())``, so forward and backward are one read of the weights each and the
step time is mostly the optimizer's. Each mode trains it with AdamW (lr 1e-3, weight decay 0.01) under a fresh
Trainer; the step is timed from ``on_train_batch_start`` to ``on_train_batch_end`` (a CUDA device is synchronised at
both ends). Modes, alternated round by round in one process (the first ``--warmup`` steps of each fit not counted;
the table gives the median over rounds of each round's median step):

- ``builtin AdamW``: ``Trainer(precision="bf16-mixed")`` with ``torch.optim.AdamW`` (its default implementation);
- ``builtin AdamW(fused)``: the same with ``fused=True``: the roofline of an fp32 update, 28 bytes moved/param;
- ``remainder``: ``MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")`` with ``torch.optim.AdamW``: the
  one-pass update (26 bytes/param), or the chunked one where it cannot be built (the table says which ran);
- ``remainder, chunked``: the same with the one-pass kernel turned off (``LIGHTNING_MP_NATIVE=0``), the path
  before it;
- ``bf16-true AdamW(fused)``: ``Trainer(precision="bf16-true")`` with ``AdamW(fused=True)``: bf16 weights and state
  (lossy), the smallest built-in;
- ``remainder AdamW8bit``: lean masters with torchao's ``AdamW8bit``, the one-pass 8-bit step
  (``master/lean/eightbit.py``); ``remainder AdamW8bit, in backward``: the same with ``optimizer_in_backward=True``;
- ``remainder AdamW8bit, generic``: lean masters with a subclass of ``AdamW8bit``: the generic path (fp32 slices,
  torchao's compiled step, split back), what ``AdamW8bit`` itself ran before the one-pass 8-bit step.

The first step of a remainder mode in a fresh process includes building the kernel (or loading it from the cache):
its time is printed under the table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

import lightning as L
import torch
from _report import QUIET_TRAINER, report
from torch import nn
from torch.utils.data import DataLoader

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.kernels import native

MODES = (
    "builtin AdamW",
    "builtin AdamW(fused)",
    "bf16-true AdamW(fused)",
    "remainder",
    "remainder, chunked",
    "remainder AdamW8bit",
    "remainder AdamW8bit, in backward",
    "remainder AdamW8bit, generic",
)


def _adamw8bit(params, generic: bool):
    from torchao.optim import AdamW8bit

    class SubclassedAdamW8bit(AdamW8bit):  # the generic path (the one-pass 8-bit step takes the exact class)
        pass

    return (SubclassedAdamW8bit if generic else AdamW8bit)(params, lr=1e-3, weight_decay=0.01)


class _OnlyParameters(L.LightningModule):
    def __init__(self, tensors: int, numel: int, fused: bool, eight_bit: str = "") -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.randn(numel) * 0.02) for _ in range(tensors)])
        self.register_buffer("scale", torch.linspace(0.5, 1.5, numel))
        self.fused = fused
        self.eight_bit = eight_bit  # "": torch's AdamW; "one pass" or "generic": torchao's AdamW8bit

    def training_step(self, batch, batch_idx):
        return sum((p * self.scale).sum() for p in self.weights)

    def configure_optimizers(self):
        if self.eight_bit:
            return _adamw8bit(self.parameters(), generic=self.eight_bit == "generic")
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, fused=self.fused or None)


class _StepTimer(L.Callback):
    def __init__(self, device: str, profile: bool = False) -> None:
        self.device = device
        self.times: list[float] = []
        self._start = 0.0
        self.profiler = None
        if profile:  # steps 5..9 of the fit (after warm-up): what each step launches and where its time goes
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, schedule=torch.profiler.schedule(
                wait=0, warmup=0, active=5, skip_first=5, repeat=1))  # fmt: skip
            self.profiler.start()

    def _sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._sync()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)
        if self.profiler is not None:
            self.profiler.step()


def _fit(mode: str, args: argparse.Namespace, profile: bool = False) -> list[float]:
    os.environ["LIGHTNING_MP_NATIVE"] = "0" if mode.endswith("chunked") else "1"
    torch.manual_seed(0)
    eight_bit = ("generic" if mode.endswith("generic") else "one pass") if "AdamW8bit" in mode else ""
    module = _OnlyParameters(args.tensors, args.numel, fused=mode.endswith("AdamW(fused)"), eight_bit=eight_bit)
    if mode.startswith("builtin"):
        precision = {"precision": "bf16-mixed"}
    elif mode.startswith("bf16-true"):
        precision = {"precision": "bf16-true"}
    else:
        plugin = MixedPrecisionPlugin(
            "bf16-mixed", master_weights="remainder", optimizer_in_backward=mode.endswith("in backward")
        )
        precision = {"plugins": [plugin]}
    timer = _StepTimer(args.device, profile)
    trainer = L.Trainer(
        accelerator=args.device, devices=1, max_steps=args.steps, **QUIET_TRAINER, callbacks=[timer], **precision
    )
    trainer.fit(module, DataLoader(range(args.steps), batch_size=1))
    if timer.profiler is not None:
        timer.profiler.stop()
        averages = timer.profiler.key_averages()
        sorts = ["self_cpu_time_total"] + (["self_cuda_time_total"] if args.device == "cuda" else [])
        for sort in sorts:  # the host's time (what a step that waits on launches is made of), then the device's
            print(f"=== profile of 5 steps: {mode}, by {sort}\n" + averages.table(sort_by=sort, row_limit=30))
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--numel", type=int, default=1 << 19)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--profile", action="store_true", help="then print a torch.profiler table of 5 steps per mode")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    rounds: dict[str, list[float]] = {mode: [] for mode in args.modes}
    first: dict[str, float] = {}
    for _ in range(args.rounds):
        for mode in args.modes:
            times = _fit(mode, args)
            first.setdefault(mode, times[0])
            rounds[mode].append(statistics.median(times[args.warmup :] or times))
    one_pass = (native.cpu_kernel() if args.device == "cpu" else native.cuda_kernel()) is not None
    reference = "builtin AdamW(fused)" if "builtin AdamW(fused)" in rounds else args.modes[0]
    base = statistics.median(rounds[reference])
    lines = [f"| mode | ms per step (median) | rounds (ms) | time vs {reference} |", "|---|---:|---|---:|"]
    for mode, values in rounds.items():
        median = statistics.median(values)
        shown = ", ".join(f"{v * 1e3:.1f}" for v in values)
        label = f"{mode} ({'one pass' if one_pass else 'chunked'})" if mode == "remainder" else mode
        lines.append(f"| {label} | {median * 1e3:.2f} | {shown} | {median / base:.2f}x |")
    lines.append("")
    lines.append("first step of the first fit (ms): " + ", ".join(f"{m} {t * 1e3:.0f}" for m, t in first.items()))
    params = args.tensors * args.numel / 1e6
    title = (
        f"A step that is the optimizer's: {args.tensors} x {args.numel} parameters ({params:.1f}M), AdamW, "
        f"{args.steps} steps x {args.rounds} rounds, {args.device}"
    )
    report(title, "\n".join(lines), args.device, args.record)
    if args.profile:
        for mode in args.modes:
            _fit(mode, args, profile=True)


if __name__ == "__main__":
    main()
