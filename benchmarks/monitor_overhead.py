"""Step-time overhead of PrecisionMonitor at its default settings vs no monitor, interleaved step by step.

    python benchmarks/monitor_overhead.py                           # both CPU workloads below
    python benchmarks/monitor_overhead.py --workloads minilm-fp32 --steps 400 --record
    python benchmarks/monitor_overhead.py --workloads mlp resnet18-28 minilm --preset cpu --steps 60

Two processes, one with ``PrecisionMonitor()`` (defaults: overflow localisation on, per-layer gradient statistics
every 100 optimizer steps, the report after fit) and one without, train the same model on the same data with the
same seed and take turns one training step at a time (``_turns.py``), so machine noise hits both alike. A step is
timed from the first callback's ``on_train_batch_start`` to the last callback's ``on_train_batch_end`` (the
monitor's hooks included). Both log to a CSVLogger.

Workloads:

- ``minilm-fp32``: the MiniLM-L6 architecture (BertClassifier, 22.7M parameters, random init), batch 16 x seq 64,
  fp32 (no plugin): the sampled gradient statistics over 22.7M values are the monitor's main cost.
- ``mlp-bf16``: a small MLP (3 x Linear(256, 256)) with ``MixedPrecisionPlugin("bf16-mixed")``: a launch-bound
  step where the per-step host work (scale / skip logging, keeping the batch and the RNG state for a replay)
  weighs the most. ``--plant K`` makes steps K, 2K, ... produce a NaN, to time the overflow localisation.
- the workloads of ``benchmarks/compare.py`` (``mlp``, ``resnet18-28``, ``resnet18-224``, ``minilm``, ``bert-base``)
  at the sizes of ``--preset`` (default ``cpu``), trained as compare's ``ours`` mode (``MixedPrecisionPlugin()``:
  bf16 on CPU), for ``--steps`` steps (default: 300; the preset's own step counts are too few to see 1%).

Reported: mean step time (all timed steps: what a run pays), the extra time of a sampled step, the overhead that
sampling every N steps implies, and the localisation's time per skipped step.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from typing import Any

import lightning as L
import torch
from _report import report
from _turns import Turns
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WORKLOADS = ("minilm-fp32", "mlp-bf16")
COMPARE_WORKLOADS = ("mlp", "resnet18-28", "resnet18-224", "minilm", "bert-base")  # benchmarks/compare.py's


class _StartClock(L.Callback):
    """First callback: starts the step's clock."""

    def __init__(self) -> None:
        self.start = 0.0

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.start = time.perf_counter()


class _StopClock(L.Callback):
    """Last callback: stops the clock, records the step's time, hands the turn to the other process."""

    def __init__(self, clock: _StartClock, turns: Turns, index: int) -> None:
        self.clock, self.turns, self.index = clock, turns, index
        self.times: list[float] = []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.turns.gather()
        self.turns.wait(self.index)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.times.append(time.perf_counter() - self.clock.start)
        self.turns.hand_on(self.index)
        self.turns.wait(self.index)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.turns.hand_on(self.index)


class _NaNAt(nn.Module):
    """Identity, except every ``every``-th optimizer step (not step 0), where it returns NaN."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every, self.step = every, lambda: 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        step = self.step()
        return x * float("nan") if self.every and step and step % self.every == 0 else x


class _MLP(L.LightningModule):
    def __init__(self, plant: int) -> None:
        super().__init__()
        planted = _NaNAt(plant)
        self.net = nn.Sequential(
            nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), planted, nn.Linear(256, 10)
        )
        planted.step = lambda: self.trainer.global_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _workload(name: str, steps: int, plant: int, preset: str) -> tuple[L.LightningModule, Any, list[Any]]:
    torch.manual_seed(0)
    if name in COMPARE_WORKLOADS:
        from compare import trainer_precision
        from workloads import build

        work = build(name, preset)
        return work.module, work.train, trainer_precision("ours", "cpu")["plugins"]
    if name == "minilm-fp32":
        from lightning_mp.samples.models import BertClassifier

        model = BertClassifier("minilm", pretrained=False, lr=1e-4)
        ids = torch.randint(1000, 5000, (steps * 16, 64))
        data = [
            {
                "input_ids": ids[i : i + 16],
                "attention_mask": torch.ones(16, 64, dtype=torch.long),
                "labels": torch.randint(0, 2, (16,)),
            }
            for i in range(0, len(ids), 16)
        ]
        return model, DataLoader(data, batch_size=None), []
    from lightning_mp import MixedPrecisionPlugin

    x = torch.randn(steps * 64, 256)
    loader = DataLoader(TensorDataset(x, torch.randint(0, 10, (len(x),))), batch_size=64)
    return _MLP(plant), loader, [MixedPrecisionPlugin("bf16-mixed")]


def _worker(name: str, monitored: bool, index: int, args: dict[str, Any], turns: Turns, results: Any) -> None:
    try:
        torch.set_num_threads(args["threads"])
        from lightning_mp import PrecisionMonitor

        model, loader, plugins = _workload(name, args["steps"], args["plant"], args["preset"])
        clock = _StartClock()
        stop = _StopClock(clock, turns, index)
        monitor = PrecisionMonitor() if monitored else None
        hook_seconds = _time_hooks(monitor) if monitor is not None else []
        with tempfile.TemporaryDirectory() as root:
            trainer = L.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=args["steps"],
                plugins=plugins,
                default_root_dir=root,
                logger=CSVLogger(root),
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[clock, *([monitor] if monitor else []), stop],
            )
            trainer.fit(model, loader)
        out: dict[str, Any] = {"times": stop.times}
        if monitor is not None:
            out["hooks"] = hook_seconds
            out["sampled"] = [s.step for s in monitor.history.samples]
            out["localised"] = [(r.step, r.seconds, r.replays, r.cause) for r in monitor.history.overflows]
        results[(name, monitored)] = out
    except BaseException:
        turns.fail()
        raise


_STEP_HOOKS = ("on_train_batch_start", "on_before_optimizer_step", "on_train_batch_end")


def _time_hooks(monitor: Any) -> list[float]:
    """Wraps the monitor's per-step hooks to add up, per step, the time spent in them: its own host work, measured
    inside the process (robust to the noise of a shared machine, which the two-process comparison is not; the
    monitor adds no host sync on a step that is neither sampled nor skipped). Returns the list it fills."""
    per_step: list[float] = []

    def timed(hook: Any, starts_step: bool) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            if starts_step:
                per_step.append(0.0)
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                per_step[-1] += time.perf_counter() - start

        return run

    for name in _STEP_HOOKS:
        setattr(monitor, name, timed(getattr(monitor, name), name == "on_train_batch_start"))
    return per_step


def _table(name: str, off: dict[str, Any], on: dict[str, Any], warmup: int, every: int) -> str:
    times_off, times_on = off["times"][warmup:], on["times"][warmup:]
    sampled = {step - warmup for step in on["sampled"] if step >= warmup}
    skipped = {step - warmup for step, *_ in on.get("localised", []) if step >= warmup}
    plain_on = [t for i, t in enumerate(times_on) if i not in sampled | skipped]
    plain_off = [t for i, t in enumerate(times_off) if i not in skipped]
    mean_off, mean_on = statistics.fmean(times_off), statistics.fmean(times_on)
    median_off, median_on = statistics.median(plain_off), statistics.median(plain_on)
    sample_cost = statistics.fmean(times_on[i] for i in sampled) - median_on if sampled else float("nan")
    lines = [
        "| | no monitor | PrecisionMonitor() | overhead |",
        "|---|---:|---:|---:|",
        f"| mean step, all {len(times_on)} timed steps (ms) | {1e3 * mean_off:.2f} | {1e3 * mean_on:.2f} | "
        f"{100 * (mean_on / mean_off - 1):+.2f}% |",
        f"| median step, neither sampled nor skipped (ms) | {1e3 * median_off:.2f} | {1e3 * median_on:.2f} | "
        f"{100 * (median_on / median_off - 1):+.2f}% |",
        f"| a sampled step's extra time (ms; {len(sampled)} sampled) | | {1e3 * sample_cost:.2f} | "
        f"{100 * sample_cost / (every * median_off):+.2f}% at sample_every={every} |",
    ]
    hooks = [t for i, t in enumerate(on["hooks"][warmup:]) if i not in sampled | skipped]
    if hooks:
        lines.append(
            f"| time in the monitor's hooks, step neither sampled nor skipped (ms, mean) | | "
            f"{1e3 * statistics.fmean(hooks):.3f} | {100 * statistics.fmean(hooks) / median_off:+.2f}% |"
        )
    for step, seconds, replays, cause in on.get("localised", []):
        lines.append(
            f"| localising skipped step {step} ({cause}, {replays} replays) (ms) | | {1e3 * seconds:.2f} | "
            f"{seconds / median_off:.1f} steps |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS + COMPARE_WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--preset", default="cpu", help="sizes of compare.py's workloads (default cpu)")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per process (default 300)")
    parser.add_argument("--warmup", type=int, default=5, help="first steps not timed (default 5)")
    parser.add_argument("--plant", type=int, default=0, help="mlp-bf16: a NaN every K steps (default 0: none)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--record", action="store_true", help="append the tables to benchmarks/HISTORY.md")
    args = parser.parse_args()
    from lightning_mp.diagnostics import PrecisionMonitor

    every = PrecisionMonitor().sample_every
    context = mp.get_context("spawn")
    for name in args.workloads:
        turns, results = Turns(2), context.Manager().dict()
        settings = {"steps": args.steps, "plant": args.plant, "threads": args.threads, "preset": args.preset}
        workers = [
            context.Process(target=_worker, args=(name, monitored, index, settings, turns, results))
            for index, monitored in enumerate((False, True))
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if any(worker.exitcode for worker in workers):
            raise SystemExit(f"{name}: a worker failed (exit codes {[w.exitcode for w in workers]})")
        sizes = f" ({args.preset} preset, ours)" if name in COMPARE_WORKLOADS else ""
        title = (
            f"PrecisionMonitor overhead, {name}{sizes}, {args.steps} steps each ({args.warmup} untimed), "
            "interleaved "
            f"step by step, {args.threads} thread(s) per process"
        )
        report(
            title, _table(name, results[(name, False)], results[(name, True)], args.warmup, every), "cpu", args.record
        )


if __name__ == "__main__":
    main()
