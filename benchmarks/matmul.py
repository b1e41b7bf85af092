"""Matmul throughput per dtype and operand layout: does half precision pay off on this device?

    python benchmarks/matmul.py                 # CUDA if present, else CPU
    python benchmarks/matmul.py --device cpu --m 1024 --k 768 --n 3072 --record

A Linear layer's training step runs three matmuls of the same size with different layouts: forward
(x @ W^T), input gradient (dY @ W) and weight gradient (dY^T @ x). Some CPU kernels are fast for one layout
and very slow for another, so each is timed on its own (median of --repeats, after a warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _report import report

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time(fn, device: str, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--m", type=int, default=1024, help="tokens in the batch")
    parser.add_argument("--k", type=int, default=768, help="input features")
    parser.add_argument("--n", type=int, default=3072, help="output features")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16", "fp16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    args = parser.parse_args()
    flops = 2 * args.m * args.k * args.n
    rows = []
    for name in args.dtypes:
        dtype = DTYPES[name]
        x = torch.randn(args.m, args.k, device=args.device, dtype=dtype)
        w = torch.randn(args.n, args.k, device=args.device, dtype=dtype)
        dy = torch.randn(args.m, args.n, device=args.device, dtype=dtype)
        layouts = {
            "forward x @ W^T": lambda x=x, w=w: x @ w.t(),
            "input grad dY @ W": lambda dy=dy, w=w: dy @ w,
            "weight grad dY^T @ x": lambda dy=dy, x=x: dy.t() @ x,
        }
        rows.append((name, {label: _time(fn, args.device, args.repeats) for label, fn in layouts.items()}))
    labels = list(rows[0][1])
    lines = [
        "| dtype | " + " | ".join(f"{label} (GFLOP/s)" for label in labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for name, times in rows:
        lines.append(f"| {name} | " + " | ".join(f"{flops / times[label] / 1e9:.1f}" for label in labels) + " |")
    report(f"Matmul {args.m}x{args.k}x{args.n} per dtype and layout", "\n".join(lines), args.device, args.record)


if __name__ == "__main__":
    main()
