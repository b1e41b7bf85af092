"""Host synchronisations per optimizer step, and what the step costs, for each path of lightning_mp.stepping.

    python benchmarks/step_syncs.py                 # both tables, printed
    python benchmarks/step_syncs.py --record        # and appended to benchmarks/HISTORY.md

Table 1 counts, with tests/helpers.HostSyncCounter, the calls that make the host wait for the device (``.item()``,
``bool(tensor)``, ``.tolist()``, ...) inside the plugin's ``optimizer_step`` (the closure, i.e. forward and backward,
not counted) over ``--steps`` steps of a tiny MLP, for fp16 dynamic / fp16 static / bf16 check-only, a fused or a
for-loop optimizer (SGD with momentum: torch's for-loop Adam reads its own step count with ``.item()``), with and
without a step-interval LR scheduler (an inf planted at step 3). It runs the path taken on accelerators (``DECIDE_CPU_FLAGS_ON_HOST = False``);
the CPU default row shows what CPU training does. The counts are exact, not timings.

Table 2 times one step (CPU thread time, median and 10th percentile over the steps after 20 of warm-up, runs of
``--timed-steps`` steps, modes alternating run by run, ``--repeats`` runs each) of the framework-bound tiny MLP of
benchmarks/workloads.py (preset ``tiny``: batch 32, hidden 64) with AdamW(fused=True) and no scheduler: Lightning's
built-in ``bf16-mixed``, ours deciding on the host (the CPU default) and ours on the device path.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import QUIET_TRAINER, report  # noqa: E402

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, stepping  # noqa: E402
from tests.helpers import HostSyncCounter, TinyRegressor, regression_loader  # noqa: E402


class _Counted(MixedPrecisionPlugin):
    """The plugin with each optimizer_step's host syncs counted, its closure (forward, backward) left out."""

    counts: list[int]

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        from torch.overrides import _pop_mode_temporarily

        def uncounted() -> Any:
            with _pop_mode_temporarily():
                return closure()

        with HostSyncCounter() as counter:
            result = super().optimizer_step(optimizer, model, uncounted, **kwargs)
        self.counts.append(len(counter.calls))
        return result


def _trainer(plugin: Any, steps: int, callbacks: Any = ()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        **QUIET_TRAINER,
        limit_val_batches=0,
        callbacks=list(callbacks),
        **({"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]}),
    )


def count_table(steps: int) -> str:
    rows = [
        "| precision | optimizer | scheduler | path | host syncs per step (each of the steps) | total |",
        "|---|---|---|---|---|---:|",
    ]
    scalers = {
        "fp16 dynamic": ("16-mixed", lambda: DynamicLossScaler(init_scale=1024.0)),
        "fp16 static": ("16-mixed", lambda: 512.0),
        "bf16 check-only": ("bf16-mixed", lambda: None),
    }
    cases = [(kind, fused, sched, False) for kind in scalers for fused in (True, False) for sched in (None, "step")]
    cases.append(("bf16 check-only", True, None, True))
    for kind, fused, sched, cpu_default in cases:
        precision, scaler = scalers[kind]
        stepping.DECIDE_CPU_FLAGS_ON_HOST = cpu_default
        torch.manual_seed(0)
        model = TinyRegressor(
            optimizer="adam" if fused else "sgd",
            fused=fused,
            scheduler=sched,
            record_grad_norms=False,
            inject_inf_at=[3],
        )
        plugin = _Counted(precision, scaler=scaler())
        plugin.counts = []
        _trainer(plugin, steps).fit(model, regression_loader(n=8 * steps))
        optimizer = "Adam(fused=True)" if fused else "SGD (for-loop)"
        path = "CPU default (host)" if cpu_default else "accelerator path"
        shown = "".join(str(c) for c in plugin.counts)
        rows.append(f"| {kind} | {optimizer} | {sched or '-'} | {path} | {shown} | {sum(plugin.counts)} |")
    stepping.DECIDE_CPU_FLAGS_ON_HOST = True
    return "\n".join(rows)


class _StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.thread_time()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.thread_time() - self._start)


def _timed_run(mode: str, steps: int) -> list[float]:
    from workloads import build

    work = build("mlp", "tiny", seed=0)
    module = work.module
    module.configure_optimizers = lambda: torch.optim.AdamW(
        module.parameters(), lr=module.lr, weight_decay=0.01, fused=True
    )
    stepping.DECIDE_CPU_FLAGS_ON_HOST = mode != "ours-bf16 (device path)"
    plugin: Any = "bf16-mixed" if mode == "builtin-bf16" else MixedPrecisionPlugin("bf16-mixed")
    timer = _StepTimer()
    _trainer(plugin, steps, [timer]).fit(module, work.train)
    stepping.DECIDE_CPU_FLAGS_ON_HOST = True
    return timer.times[20:]


def time_table(steps: int, repeats: int) -> str:
    modes = ["builtin-bf16", "ours-bf16 (host decision, CPU default)", "ours-bf16 (device path)"]
    runs: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            times = sorted(_timed_run(mode, steps))
            runs[mode].append((statistics.median(times), times[len(times) // 10]))
    base = statistics.median(m for m, _ in runs["builtin-bf16"])
    base10 = statistics.median(p for _, p in runs["builtin-bf16"])
    rows = [
        "| mode | step CPU ms, median of run medians | p10 | speed vs built-in (median, p10) |",
        "|---|---:|---:|---:|",
    ]
    for mode in modes:
        median = statistics.median(m for m, _ in runs[mode])
        p10 = statistics.median(p for _, p in runs[mode])
        rows.append(f"| {mode} | {1e3 * median:.3f} | {1e3 * p10:.3f} | {base / median:.2f}x, {base10 / p10:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per counted run (an inf is planted at step 3)")
    parser.add_argument("--timed-steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = count_table(args.steps)
    print(counts, flush=True)
    times = time_table(args.timed_steps, args.repeats)
    report(
        "Host syncs per optimizer step and step time by path (issue 19, item 4)",
        f"{counts}\n\n{times}",
        "cpu",
        args.record,
    )


if __name__ == "__main__":
    main()
