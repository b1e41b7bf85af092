"""The lean update's contract and speed on one device: each kernel's distance from a float64 evaluation, and the
Triton kernel's bandwidth per launch shape.

    python benchmarks/kernel_contract.py --device cpu                 # torch's CPU kernel against ours (C kernel)
    TRITON_INTERPRET=1 python benchmarks/kernel_contract.py --device cpu --path triton   # the CUDA kernel, interpreted
    python benchmarks/kernel_contract.py --device cuda --tune --record   # on a GPU: contract, then launch shapes

Contract (:mod:`lightning_mp.kernels.contract`): one step of each optimizer configuration from the same random
fp32 values, by torch's fused kernel on the device and by ours, each compared with a float64 evaluation of the
formula; the largest distance in units in the last place, per gradient dtype. On CUDA both arithmetics of the Triton
kernel are measured: torch's (fp32 variables where torch's kernel has them) and ``precise`` (fp64 intermediates,
each stored value rounded once).

Tuning (``--tune``, CUDA): AdamW on ``--params`` million parameters in ``--tensors`` tensors, bf16 gradients; the
median of ``--reps`` steps timed with CUDA events, as effective bandwidth at 26 bytes/param (lean) or 28 (fp32: torch's
fused kernel, the reference), and a device-to-device copy as the ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import report

from lightning_mp.kernels import contract

#: launch shapes tried by --tune: (BLOCK, CHUNK, WARPS, PRECISE); precise arithmetic is the default's (the contract
#: table shows why), torch's arithmetic timed once for its cost
SHAPES = [
    (1024, 1024, 4, 0), (1024, 1024, 4, 1), (512, 512, 4, 1), (512, 2048, 4, 1), (1024, 2048, 4, 1),
    (1024, 4096, 4, 1), (1024, 1024, 8, 1), (2048, 2048, 8, 1), (2048, 4096, 8, 1), (2048, 8192, 8, 1),
    (4096, 4096, 8, 1), (4096, 8192, 16, 1),
]  # fmt: skip


def contract_table(device: torch.device, path: str, variants: list[tuple[str, str]]) -> tuple[str, list[dict]]:
    """One row per configuration and gradient dtype: torch's distance, ours per variant (name, config env)."""
    sizes = (1 << 16, 1 << 16, 4099, 7) if device.type == "cuda" or path == "cpu" else (1 << 15, 1 << 15, 7)
    head = "| optimizer | grad | torch's fused | " + " | ".join(f"ours, {n}" for n, _ in variants) + " | within |"
    lines = [head, "|---|---|---:|" + "---:|" * len(variants) + "---|"]
    rows = []
    for grad_dtype in (torch.bfloat16, torch.float32):
        for kind, flags in contract.CASES:
            found = {}
            for name, env in variants:
                if env:
                    os.environ["LIGHTNING_MP_TRITON_CONFIG"] = env
                else:
                    os.environ.pop("LIGHTNING_MP_TRITON_CONFIG", None)
                found[name] = contract.measure(kind, flags, device, path, grad_dtype, sizes=sizes, seeds=2)
            theirs = max(r["torch"] for r in found.values())
            ok = all(r["ours"] <= contract.bound(theirs) for r in found.values())
            cells = " | ".join(f"{r['ours']:.2f}" for r in found.values())
            dtype = str(grad_dtype).removeprefix("torch.")
            lines.append(
                f"| {contract.case_name(kind, flags)} | {dtype} | {theirs:.2f} | {cells} | {'yes' if ok else 'NO'} |"
            )
            rows.append({"case": contract.case_name(kind, flags), "grad": dtype, "torch": theirs,
                         **{name: r["ours"] for name, r in found.items()}})  # fmt: skip
    os.environ.pop("LIGHTNING_MP_TRITON_CONFIG", None)
    return "\n".join(lines), rows


def _time(fn, reps: int, inner: int = 10) -> float:
    """Seconds per call of ``fn``: the median over ``reps`` rounds of ``inner`` calls queued between two CUDA events
    (the host runs ahead, so its launch overhead overlaps the device's work: the device's time per update, as in a
    training loop), after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return statistics.median(times)


def _fp32_rows(args: argparse.Namespace, n: int) -> list[dict]:
    """torch's fused fp32 AdamW and a device copy of the same number of floats (the ceiling), timed."""
    device = torch.device("cuda")
    weights = [torch.randn(n, device=device) * 0.02 for _ in range(args.tensors)]
    grads = [torch.randn(n, device=device) * 1e-3 for _ in range(args.tensors)]
    m = [torch.zeros(n, device=device) for _ in range(args.tensors)]
    v = [torch.zeros(n, device=device) for _ in range(args.tensors)]
    steps = [torch.tensor(1.0, device=device) for _ in range(args.tensors)]

    def fused() -> None:
        torch._fused_adamw_(weights, grads, m, v, [], steps, amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                            weight_decay=0.01, eps=1e-8, maximize=False, grad_scale=None, found_inf=None)  # fmt: skip

    rows = [{"option": "torch fused AdamW, fp32", "seconds": _time(fused, args.reps), "bytes": 28}]
    source = torch.cat(weights)
    target = torch.empty_like(source)
    rows.append({"option": "copy (read + write: the ceiling)", "bytes": 8,
                 "seconds": _time(lambda: target.copy_(source), args.reps)})  # fmt: skip
    return rows


def tune_table(args: argparse.Namespace) -> tuple[str, list[dict]]:
    """Bandwidth of torch's fused fp32 AdamW, a copy, and the Triton kernel per launch shape and arithmetic."""
    from lightning_mp.kernels import native
    from lightning_mp.kernels.bits import split_fp32
    from lightning_mp.kernels.cuda import CudaLeanUpdate

    device = torch.device("cuda")
    n = int(args.params * 1e6) // args.tensors
    total = n * args.tensors
    rows = _fp32_rows(args, n)
    torch.cuda.empty_cache()
    halves = [split_fp32(torch.randn(n, device=device) * 0.02) for _ in range(args.tensors)]
    grads = [(torch.randn(n, device=device) * 1e-3).bfloat16() for _ in range(args.tensors)]
    m = [torch.zeros(n, device=device) for _ in range(args.tensors)]
    v = [torch.zeros(n, device=device) for _ in range(args.tensors)]
    steps = [torch.tensor(1.0, device=device) for _ in range(args.tensors)]
    table = [[h.data_ptr(), lo.data_ptr(), g.data_ptr(), a.data_ptr(), b.data_ptr(), 0, n]
             for (h, lo), g, a, b in zip(halves, grads, m, v)]  # fmt: skip
    options = dict(kind=native.ADAMW, grad_fp32=False, amsgrad=False, maximize=False, lr=1e-3, beta1=0.9,
                   beta2=0.999, weight_decay=0.01, eps=1e-8, clamped=False, clamp=-1.0)  # fmt: skip
    for shape in SHAPES:
        config = ",".join(map(str, shape))
        os.environ["LIGHTNING_MP_TRITON_CONFIG"] = config
        update = CudaLeanUpdate()
        try:
            seconds = _time(lambda u=update: u.run(0, table, steps, options, None, None, device), args.reps)
        except Exception as error:  # a shape the compiler refuses: reported, the others still run
            print(f"shape {config}: {type(error).__name__}: {error}")
            continue
        name = f"Triton {shape[0]},{shape[1]},{shape[2]}" + (" precise" if shape[3] else ", torch's arithmetic")
        rows.append({"option": name, "seconds": seconds, "bytes": 26, "config": config})
    os.environ.pop("LIGHTNING_MP_TRITON_CONFIG", None)
    base = rows[0]["seconds"]
    lines = ["| option | ms (median) | GB/s | time vs torch fused |", "|---|---:|---:|---:|"]
    for row in rows:
        row["gbps"] = total * row["bytes"] / row["seconds"] / 1e9
        lines.append(f"| {row['option']} | {row['seconds'] * 1e3:.3f} | {row['gbps']:.0f} | "
                     f"{row['seconds'] / base:.2f}x |")  # fmt: skip
    return "\n".join(lines), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--path", choices=["cpu", "triton"], default=None, help="default: the device's kernel")
    parser.add_argument("--tune", action="store_true", help="CUDA: time the Triton kernel per launch shape")
    parser.add_argument("--params", type=float, default=128.0, help="millions of parameters (--tune)")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="write every row here")
    parser.add_argument("--best", type=Path, default=None, help="--tune: write the fastest precise shape here")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    path = args.path or ("cpu" if args.device == "cpu" else "triton")
    if path == "triton":  # the default launch shape, in both arithmetics
        from lightning_mp.kernels.cuda import CONFIG

        shape = f"{CONFIG.block},{CONFIG.chunk},{CONFIG.warps}"
        variants = [("torch's arithmetic", f"{shape},0"), ("precise", f"{shape},1")]
    else:
        variants = [("C kernel", "")]
    text, rows = contract_table(device, path, variants)
    out = {"contract": rows}
    title = f"Lean update contract: largest distance from a float64 evaluation (ulp), {path} kernel on {args.device}"
    report(title, text, args.device, args.record)
    if args.tune:
        text, out["tune"] = tune_table(args)
        title = f"Lean update, AdamW on {args.params:g}M parameters in {args.tensors} tensors: launch shapes"
        report(title, text, args.device, args.record)
        precise = [row for row in out["tune"] if row.get("config", "").endswith(",1")]
        if args.best and precise:
            args.best.write_text(min(precise, key=lambda row: row["seconds"])["config"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
