"""The inf/NaN check of a check-only step (bf16, no loss scale) on the CPU: torch's kernel against the compiled one.

    python benchmarks/grad_check.py [--rounds 15] [--shrink 1] [--record]

A bf16 step has no loss scale, but the plugin still checks every gradient for inf/NaN (a non-finite step is skipped).
torch's ``_amp_foreach_non_finite_check_and_unscale_`` reads each gradient and writes it back multiplied by one;
the compiled check (``lightning_mp.kernels.native.check_nonfinite``, used from 2^20 gradient elements) only reads.
Layouts, bf16 gradients: many mid-sized tensors that fit the last-level cache together (32 x 2^19, the
``step_alone.py`` model), the same out of cache (256 x 2^19, 268 MB), and one large tensor (2^27 values: an
embedding's gradient, which only a check that cuts tensors into units shares among threads). All of torch's threads;
the methods alternate round by round, the table gives the median and the read bandwidth (2 bytes a value).
``--shrink N`` divides every tensor's size by N (a quick run).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import report

from lightning_mp.kernels import native

LAYOUTS = {"32 x 2^19": (32, 1 << 19), "256 x 2^19": (256, 1 << 19), "1 x 2^27": (1, 1 << 27)}


def _torch_check(grads: list[torch.Tensor], found: torch.Tensor) -> None:
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, torch.ones(1))


def _compiled_check(grads: list[torch.Tensor], found: torch.Tensor) -> None:
    if not native.check_nonfinite(grads, found):
        sys.exit("the compiled check is not built here (no C compiler, or LIGHTNING_MP_NATIVE=0)")


METHODS = {"torch kernel (read + write)": _torch_check, "compiled check (read only)": _compiled_check}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--shrink", type=int, default=1)
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    found = torch.zeros(1)
    lines = ["| gradients | method | ms (median) | GB/s read |", "|---|---|---:|---:|"]
    for layout, (count, numel) in LAYOUTS.items():
        numel //= args.shrink
        grads = [torch.randn(numel).bfloat16() for _ in range(count)]
        times: dict[str, list[float]] = {method: [] for method in METHODS}
        for _ in range(args.rounds + 1):  # the first round warms up
            for method, check in METHODS.items():
                start = time.perf_counter()
                check(grads, found)
                times[method].append(time.perf_counter() - start)
        assert found.item() == 0.0, "random normal gradients read as non-finite"
        for method, values in times.items():
            median = statistics.median(values[1:])
            lines.append(f"| {layout} | {method} | {median * 1e3:.2f} | {count * numel * 2 / median / 1e9:.1f} |")
        del grads
    shrunk = f", sizes / {args.shrink}" if args.shrink > 1 else ""
    title = f"The check-only step's inf/NaN check of bf16 gradients, CPU, {torch.get_num_threads()} threads{shrunk}"
    report(title, "\n".join(lines), "cpu", args.record)


if __name__ == "__main__":
    main()
