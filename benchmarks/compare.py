"""Speed, memory and accuracy of every precision mode, side by side, on the same model, data and machine.

    python benchmarks/compare.py                                  # every workload of the device's preset
    python benchmarks/compare.py --workloads minilm mlp --record  # some workloads; append to HISTORY.md
    python benchmarks/compare.py --preset tiny --device cpu       # seconds: the same code at toy sizes

Modes (``--modes``): ``fp32`` (Trainer precision "32-true"), Lightning's built-in ``builtin-16`` ("16-mixed") and
``builtin-bf16`` ("bf16-mixed"), and ours: ``ours`` (``MixedPrecisionPlugin()``: fp16 autocast + our scaler on
CUDA, bf16 on CPU), ``ours-bf16`` (not run by default), ``ours+masters`` (``master_weights=True``) and
``ours+masters+fast`` (plus the ``fast`` policy preset), ``ours+remainder`` (bf16, ``master_weights="remainder"``:
lean masters, bf16 weights + 16-bit remainders). On CPU Lightning runs "16-mixed" as bf16, so the CPU
default leaves out ``builtin-16``.

How it measures. Each mode trains in a process of its own (its own peak memory, no state shared) with a
Lightning ``Trainer`` and the same seed, model and data order. The processes take turns, one training step at a
time in round-robin order (``_turns.py``), so the modes are interleaved step by step and machine noise hits them
alike; no mode's timed steps overlap another's start-up or evaluation. A step is timed from
``on_train_batch_start`` to ``on_train_batch_end`` with device synchronisation on both sides (forward, backward,
unscale, optimizer step; the next batch is loaded while the others wait); throughput is the batch size over the
median time of the steps after ``warmup``. Peak memory is ``torch.cuda.max_memory_allocated`` during training on
CUDA, and on CPU the growth of the peak RSS over the RSS before the data and model were built. MFU
(transformers) is the model's training FLOPs per second over a matmul ceiling measured on the same device in the
dtype the mode's matmuls run in (the best of the three matmul layouts of a training step). Quality is the mean
training loss over the last 10 steps of the fixed-length run and the accuracy on held-out data, evaluated in the
same mode.

Writes ``<out>/results.json``, ``<out>/results.md`` and ``<out>/chart.png`` (throughput and peak memory by mode,
relative to fp32, with the built-in's level marked); ``--record`` appends the tables to benchmarks/HISTORY.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import queue
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fp8 import DECODER_MODES, FP8_MODES, prepare
from _report import QUIET_TRAINER, machine, report
from _turns import TakeTurns, Turns

#: mode -> how the Trainer gets its precision: a Lightning flag, or MixedPrecisionPlugin arguments
MODES: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "32-true"},
    "builtin-16": {"precision": "16-mixed"},
    "builtin-bf16": {"precision": "bf16-mixed"},
    "ours": {"plugin": {}},
    "ours-bf16": {"plugin": {"precision": "bf16-mixed"}},
    "ours+masters": {"plugin": {"master_weights": True}},
    "ours+masters+fast": {"plugin": {"master_weights": True, "policy": "fast"}},
    # lean masters: bf16 model + 16-bit remainders (bf16 only, on every device)
    "ours+remainder": {"plugin": {"precision": "bf16-mixed", "master_weights": "remainder"}},
    **FP8_MODES,  # fp8 vs bf16, eager and compiled, ours and torchao by hand (_fp8.py; the decoder's default)
}
DEFAULT_MODES = {
    "cuda": [mode for mode in MODES if mode != "ours-bf16"],
    "cpu": ["fp32", "builtin-bf16", "ours", "ours+masters", "ours+masters+fast", "ours+remainder"],
}
LAST_LOSSES = 10


def mode_precision(mode: str, device: str) -> str:
    """The precision a mode trains with: its Lightning flag, or its plugin's (default: fp16 on CUDA, bf16 on CPU)."""
    spec = MODES[mode]
    default = "16-mixed" if device == "cuda" else "bf16-mixed"
    return spec.get("precision") or spec["plugin"].get("precision") or default


def mode_dtype(mode: str, device: str) -> torch.dtype:
    """The dtype a mode's matmuls run in (Lightning runs "16-mixed" as bf16 on CPU)."""
    precision = mode_precision(mode, device)
    if precision == "32-true":
        return torch.float32
    return torch.float16 if precision == "16-mixed" and device == "cuda" else torch.bfloat16


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the key of the rows' dtype and of the ceilings."""
    return str(dtype).removeprefix("torch.")


def trainer_precision(mode: str, device: str) -> dict[str, Any]:
    """The Trainer keyword that sets ``mode``: ``precision=`` or ``plugins=[MixedPrecisionPlugin(...)]``."""
    from lightning_mp import MixedPrecisionPlugin

    spec = MODES[mode]
    if "precision" in spec:
        return {"precision": spec["precision"]}
    return {"plugins": [MixedPrecisionPlugin(**{**spec["plugin"], "precision": mode_precision(mode, device)})]}


# ------------------------------------------------------------------------------------------------ workers


def _worker(workload: str, mode: str, index: int, args: dict[str, Any], turns: Turns, results: Any) -> None:
    try:
        results.put(_train(workload, mode, index, args, turns))
    except BaseException:
        turns.fail()
        results.put({"workload": workload, "mode": mode, "error": traceback.format_exc()})


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _train(workload: str, mode: str, index: int, args: dict[str, Any], turns: Turns) -> dict[str, Any]:
    import warnings

    import lightning as L
    from workloads import build

    warnings.filterwarnings("ignore")
    device = args["device"]
    rss_before = _rss()  # CPU peak memory: growth over this (the data, the same in every mode, included)
    work = build(workload, args["preset"], seed=args["seed"])
    prepare(MODES[mode], work.module, device)
    profile_path = Path(args["out"]) / f"profile-{workload}-{mode}.txt" if mode in args["profile"] else None
    timer = TakeTurns(turns, index, device, profile_path)
    trainer = L.Trainer(
        accelerator=device,
        devices=1,
        max_steps=args["steps"] or work.steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        **QUIET_TRAINER,
        callbacks=[timer],
        **trainer_precision(mode, device),
    )
    trainer.fit(work.module, work.train)
    peak = timer.peak if device == "cuda" else _rss() - rss_before
    turns.gather()  # the modes still training are timed: evaluate once all are done
    trainer.test(work.module, work.test, verbose=False)
    timed = timer.times[min(work.warmup, len(timer.times) - 1) :]
    step_s = statistics.median(timed)
    p10_p90 = statistics.quantiles(timed, n=10, method="inclusive")[::8] if len(timed) >= 2 else [step_s] * 2
    losses = torch.stack(work.module.losses).float().cpu()
    return {
        "workload": workload,
        "mode": mode,
        "dtype": dtype_name(mode_dtype(mode, device)),
        "batch": work.batch,
        "steps": len(timer.times),
        "timed_steps": len(timed),
        "step_ms": 1e3 * step_s,
        "step_ms_p10_p90": [1e3 * q for q in p10_p90],
        "samples_s": work.batch / step_s,
        "tokens_s": work.batch * work.tokens_per_sample / step_s if work.tokens_per_sample else None,
        "model_tflops_s": work.batch * work.flops_per_sample / step_s / 1e12 if work.flops_per_sample else None,
        "peak_mib": peak / 2**20,
        "final_loss": losses[-LAST_LOSSES:].mean().item(),
        "nonfinite_losses": int((~torch.isfinite(losses)).sum()),
        "test_acc": work.module.correct / max(1, work.module.seen),
        "test_n": work.module.seen,
        "skipped_steps": _skipped(getattr(trainer.precision_plugin, "scaler", None)),
        "order": timer.order,
    }


def _skipped(scaler: Any) -> int | None:
    """Optimizer steps the loss scaler skipped: ours keeps a count; Lightning's GradScaler does not (None)."""
    if scaler is not None and hasattr(scaler, "skipped_steps"):
        return int(scaler.skipped_steps)
    return None


# --------------------------------------------------------------------------------------------- ceilings


def matmul_ceiling(device: str, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """Measured FLOP/s of an n x n x n matmul in ``dtype``: the best of the three layouts a linear layer's training
    step uses (``x @ W.T``, ``dY @ W``, ``dY.T @ x``; they differ by up to 200x on CPUs without native bf16), each
    the median of ``repeats`` after 3 warm-ups."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = 0.0
    for left, right in ((a, b.t()), (a, b), (a.t(), b)):
        times = []
        for i in range(repeats + 3):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            left @ right
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - start)
        best = max(best, 2.0 * n**3 / statistics.median(times))
    return best


# ---------------------------------------------------------------------------------------------- driver


def run_workload(workload: str, modes: list[str], args: dict[str, Any]) -> list[dict[str, Any]]:
    """Train ``workload`` once per mode, the modes' processes taking turns step by step; one row per mode."""
    context = mp.get_context("spawn")
    turns = Turns(len(modes))
    results = context.Queue()
    processes = [
        context.Process(target=_worker, args=(workload, mode, i, args, turns, results), daemon=True)
        for i, mode in enumerate(modes)
    ]
    for process in processes:
        process.start()
    rows, deadline = [], time.monotonic() + args["timeout"]
    while len(rows) < len(modes):
        try:
            # wait at most until the deadline, so a short --timeout is noticed even while results keep coming
            rows.append(results.get(timeout=min(5.0, max(0.05, deadline - time.monotonic()))))
        except queue.Empty:  # check that nobody died without reporting, or hangs
            dead = [m for m, p in zip(modes, processes) if p.exitcode not in (None, 0)]
            late = time.monotonic() > deadline
            if dead or late:
                turns.fail()
                for process in processes:
                    process.terminate()
                why = (
                    f"did not finish within --timeout {args['timeout']} s"
                    if late
                    else (f"the process of mode(s) {dead} died without a result")
                )
                raise RuntimeError(f"workload {workload!r}: {why}") from None
    for process in processes:
        process.join(timeout=60)
    errors = [row for row in rows if "error" in row]
    if errors:
        knock_on = ("another mode's process failed", "BrokenBarrierError")  # what the first failure caused
        first = next((r for r in errors if not any(text in r["error"] for text in knock_on)), errors[0])
        raise RuntimeError(f"workload {workload!r}, mode {first['mode']!r} failed:\n{first['error']}")
    return sorted(rows, key=lambda row: modes.index(row["mode"]))


def add_ratios(rows: list[dict[str, Any]], reference: str, ceilings: dict[str, float]) -> None:
    """Throughput and memory relative to fp32 and to Lightning's built-in; MFU against the measured ceiling."""
    fp32 = next((r for r in rows if r["mode"] == "fp32"), None)
    builtin = next((r for r in rows if r["mode"] == reference), None)
    for row in rows:
        for name, base in (("fp32", fp32), ("builtin", builtin)):
            row[f"speed_vs_{name}"] = row["samples_s"] / base["samples_s"] if base else None
            row[f"memory_vs_{name}"] = row["peak_mib"] / base["peak_mib"] if base and base["peak_mib"] > 0 else None
            row[f"acc_minus_{name}"] = row["test_acc"] - base["test_acc"] if base else None
        ceiling = ceilings.get(row["dtype"])
        row["mfu"] = row["model_tflops_s"] * 1e12 / ceiling if row["model_tflops_s"] and ceiling else None


def markdown(rows: list[dict[str, Any]], reference: str) -> str:
    def fmt(value: Any, spec: str, unit: str = "") -> str:
        return "-" if value is None else format(value, spec) + unit

    lines = [
        f"| mode | dtype | step ms (p10-p90) | samples/s | tokens/s | MFU | peak MiB | speed vs fp32 | speed vs "
        f"{reference} | memory vs fp32 | memory vs {reference} | final loss | test acc (n) | skipped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p10, p90 = r["step_ms_p10_p90"]
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['step_ms']:.1f} ({p10:.1f}-{p90:.1f}) | {r['samples_s']:.1f} "
            f"| {fmt(r['tokens_s'], '.0f')} | {fmt(r['mfu'] and 100 * r['mfu'], '.1f', '%')} "
            f"| {r['peak_mib']:.0f} | {fmt(r['speed_vs_fp32'], '.2f', 'x')} | {fmt(r['speed_vs_builtin'], '.2f', 'x')} "
            f"| {fmt(r['memory_vs_fp32'], '.2f', 'x')} | {fmt(r['memory_vs_builtin'], '.2f', 'x')} "
            f"| {r['final_loss']:.4f} "
            f"| {r['test_acc']:.4f} ({r['test_n']}) | {fmt(r['skipped_steps'], 'd')} |"
        )
    return "\n".join(lines)


def chart(results: dict[str, list[dict[str, Any]]], reference: str, path: Path, title: str) -> None:
    """Bars of throughput and peak memory per mode relative to fp32, one row per workload; a dashed line marks
    Lightning's built-in, so the bar's height over it is the ratio to the built-in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 2, figsize=(13, 2.8 * len(results) + 0.8), squeeze=False)
    for row_axes, (workload, rows) in zip(axes, results.items()):
        modes = [r["mode"] for r in rows]
        colors = ["#888888" if m == "fp32" else "#4c72b0" if m.startswith("builtin") else "#dd8452" for m in modes]
        for ax, key, label in (
            (row_axes[0], "speed_vs_fp32", "throughput / fp32"),
            (row_axes[1], "memory_vs_fp32", "peak memory / fp32"),
        ):
            values = [r[key] or 0.0 for r in rows]
            bars = ax.bar(range(len(rows)), values, color=colors)
            for bar, r in zip(bars, rows):
                vs_builtin = r[key.replace("fp32", "builtin")]
                text = f"{bar.get_height():.2f}" + (f"\n({vs_builtin:.2f}b)" if vs_builtin else "")
                ax.annotate(
                    text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7
                )
            base = next((r[key] for r in rows if r["mode"] == reference), None)
            if base:
                ax.axhline(base, linestyle="--", color="#4c72b0", linewidth=1, label=f"{reference}")
                ax.legend(fontsize=7, loc="upper left")
            ax.axhline(1.0, color="#888888", linewidth=0.8)
            ax.set_xticks(range(len(rows)), modes, rotation=20, fontsize=7)
            ax.set_ylim(0, max(values + [1.0]) * 1.3)
            ax.set_title(f"{workload}: {label} (b = / {reference})", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    from workloads import PRESETS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="sizes; default: the device's")
    parser.add_argument("--workloads", nargs="+", default=None, help="default: every workload of the preset")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=None, help="default: the device's")
    parser.add_argument("--steps", type=int, default=None, help="training steps per mode (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per workload before giving up")
    parser.add_argument(
        "--profile",
        nargs="*",
        default=[],
        choices=list(MODES),
        help="modes to trace with torch.profiler in steps 8-12 (it slows them): <out>/profile-<workload>-<mode>.txt",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/out/<device>-<preset>")
    parser.add_argument("--record", action="store_true", help="append the tables to benchmarks/HISTORY.md")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    preset = args.preset or ("gpu" if args.device == "cuda" else "cpu")
    workloads = args.workloads or [w for w in PRESETS[preset] if not w.startswith("decoder")]  # fp8: name it
    unknown = [w for w in workloads if w not in PRESETS[preset]]
    if unknown:
        parser.error(f"workload(s) {unknown} have no sizes in preset {preset!r}: use {sorted(PRESETS[preset])}")
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps {args.steps}: at least 2 (one warm-up step and one timed step)")
    chosen = {
        w: args.modes or (DECODER_MODES if w.startswith("decoder") else DEFAULT_MODES)[args.device] for w in workloads
    }
    modes = list(dict.fromkeys(m for w in workloads for m in chosen[w]))
    references = {
        w: "builtin-16" if args.device == "cuda" and "builtin-16" in chosen[w] else "builtin-bf16" for w in workloads
    }
    out = args.out or Path(__file__).resolve().parent / "out" / f"{args.device}-{preset}"
    out.mkdir(parents=True, exist_ok=True)

    n = 256 if preset == "tiny" else 8192 if args.device == "cuda" else 1024
    ceilings = {dtype_name(d): matmul_ceiling(args.device, d, n) for d in {mode_dtype(m, args.device) for m in modes}}
    shared = {
        "device": args.device,
        "preset": preset,
        "steps": args.steps,
        "seed": args.seed,
        "out": str(out),
        "profile": args.profile,
        "timeout": args.timeout,
    }
    results: dict[str, list[dict[str, Any]]] = {}
    for workload in workloads:
        started = time.perf_counter()
        reference = references[workload]
        results[workload] = run_workload(workload, chosen[workload], shared)
        add_ratios(results[workload], reference, ceilings)
        print(f"{workload}: {time.perf_counter() - started:.0f} s", flush=True)
        print(markdown(results[workload], reference), flush=True)

    header = (
        f"Matmul ceilings ({n}x{n}x{n}, measured): "
        + ", ".join(f"{d} {c / 1e12:.3g} TFLOP/s" for d, c in sorted(ceilings.items()))
        + f". {_versions()}."
        + (
            f" fp32 matmul precision {torch.get_float32_matmul_precision()!r}, cuDNN TF32 "
            f"{'on' if torch.backends.cudnn.allow_tf32 else 'off'} (the defaults: fp32 matmuls are true fp32, "
            "fp32 convolutions may use TF32)."
            if args.device == "cuda"
            else ""
        )
    )
    text = (
        header
        + "\n\n"
        + "\n\n".join(
            f"**{w}** ({_describe(preset, w, args.steps)})\n\n{markdown(rows, references[w])}"
            for w, rows in results.items()
        )
    )
    title = f"Precision modes side by side, preset {preset}, interleaved step by step"
    (out / "results.json").write_text(
        json.dumps(
            {
                "device": args.device,
                "machine": machine(args.device),
                "torch": torch.__version__,
                "versions": _versions(),
                "preset": preset,
                "reference": reference,
                "references": references,
                "ceilings_flops": ceilings,
                "command": sys.argv,
                "results": results,
            },
            indent=1,
        )
    )
    (out / "results.md").write_text(f"## {title}\n\n{text}\n")
    chart(results, reference, out / "chart.png", f"{title} ({machine(args.device)})")
    report(title, text + f"\n\nChart: `{out / 'chart.png'}`", args.device, args.record)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for name in ("lightning", "transformers"):
        try:
            found.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


def _describe(preset: str, workload: str, steps: int | None) -> str:
    from workloads import PRESETS

    sizes = {**PRESETS[preset][workload], **({"steps": steps} if steps else {})}
    return ", ".join(f"{k} {v}" for k, v in sizes.items() if k != "config")


if __name__ == "__main__":
    main()
