"""The optimizer step alone: lean masters' chunked update against torch's AdamW on fp32 parameters.

    python benchmarks/lean_step.py                      # 16M parameters in 32 tensors, CUDA if present, else CPU
    python benchmarks/lean_step.py --params 4 --record  # 4M parameters; append the table to HISTORY.md

Options timed, interleaved round by round (each round runs every option once; the median over rounds is shown):

- ``fp32 foreach``: ``torch.optim.AdamW`` (default implementation) on fp32 parameters: what Lightning's built-in
  ``bf16-mixed`` steps (its model is fp32);
- ``fp32 fused``: the same with ``fused=True``;
- ``flat fp32 masters``: ours with ``master_weights=True``: AdamW (foreach) on the flat fp32 masters, then the
  copy into the bf16 model;
- ``remainder, one pass``: ours with ``master_weights="remainder"``: the one-pass update (a compiled C
  kernel on CPU, the Triton kernel on CUDA, the default on both: :mod:`lightning_mp.master.lean.plan`);
- ``remainder, chunk N``: the chunked path it replaced (``LIGHTNING_MP_NATIVE=0``): join bf16 + remainder into an fp32 chunk,
  torch's fused AdamW kernel on it, split back (eager ops), for chunk sizes N;
- ``remainder, chunk N, compile=True``: the same with the split compiled by ``torch.compile`` (one loop; the
  AdamW arithmetic stays torch's fused kernel, so results are unchanged).

Bytes moved per parameter by a single-pass update: fp32 AdamW reads weight, grad, two moments (16) and writes
weight and moments (12): 28; lean reads bf16 weight, remainder, bf16 grad, moments (14) and writes weight,
remainder, moments (12): 26. The table gives each option's time per step and its effective bandwidth at 28 (or 26)
bytes per parameter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import report


def _model(params_m: float, tensors: int) -> nn.Module:
    per = int(params_m * 1e6) // tensors
    rows = max(1, per // 1024)
    return nn.ParameterList([nn.Parameter(torch.randn(rows, 1024) * 0.02) for _ in range(tensors)])


def _fill_grads(module: nn.Module, dtype: torch.dtype) -> None:
    for p in module.parameters():
        p.grad = (torch.randn(p.shape, device=p.device) * 1e-3).to(dtype)


def _options(args: argparse.Namespace, device: str) -> dict[str, Callable[[], Callable[[], None]]]:
    from lightning_mp.master import MasterWeights, RemainderMasters

    def fp32(fused: bool) -> Callable[[], None]:
        model = _model(args.params, args.tensors).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused, foreach=None if fused else True)
        _fill_grads(model, torch.float32)
        return opt.step

    def flat() -> Callable[[], None]:
        model = _model(args.params, args.tensors).to(device)
        store = MasterWeights(torch.bfloat16, keep_fp32=lambda *a: False)
        store.convert(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        store.attach([opt])
        _fill_grads(model, torch.bfloat16)
        store.grads_to_masters()

        def run() -> None:
            opt.step()
            store.masters_to_model(opt)

        return run

    def lean(chunk: int, compiled: bool, one_pass: bool = False) -> Callable[[], None]:
        model = _model(args.params, args.tensors).to(device)
        store = RemainderMasters(keep_fp32=lambda *a: False, chunk_size=chunk, compile=compiled)
        store.convert(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        store.attach([opt])
        _fill_grads(model, torch.bfloat16)

        def run() -> None:
            os.environ["LIGHTNING_MP_NATIVE"] = "1" if one_pass else "0"  # the chunked rows: the path before it
            os.environ["LIGHTNING_MP_CUDA_ONE_PASS"] = "1" if one_pass else "0"  # the default on CUDA
            store.fused_step(opt, None)

        return run

    options: dict[str, Callable[[], Callable[[], None]]] = {
        "fp32 foreach (built-in's step)": lambda: fp32(False),
        "fp32 fused": lambda: fp32(True),
        "flat fp32 masters (master_weights=True)": flat,
        "remainder, one pass": lambda: lean(1 << 20, False, one_pass=True),
    }
    for chunk in args.chunks:
        options[f"remainder, chunk 2^{chunk.bit_length() - 1}"] = lambda c=chunk: lean(c, False)
    for chunk in args.chunks if args.compiled else ():
        options[f"remainder, chunk 2^{chunk.bit_length() - 1}, compile=True"] = lambda c=chunk: lean(c, True)
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=float, default=16.0, help="millions of parameters")
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1 << 16, 1 << 18, 1 << 20])
    parser.add_argument("--no-compiled", dest="compiled", action="store_false")
    parser.add_argument("--record", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    steps = {name: make() for name, make in _options(args, args.device).items()}
    for run in steps.values():  # warm-up (and compile)
        run()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, run in steps.items():
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            if cuda:
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    count = int(args.params * 1e6) // args.tensors // 1024 * 1024 * args.tensors
    base = statistics.median(times["fp32 foreach (built-in's step)"])
    lines = [
        "| option | step (ms, median) | vs built-in's step | GB/s at 28 (fp32) or 26 (lean) bytes/param |",
        "|---|---:|---:|---:|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        moved = (26 if name.startswith("remainder") else 28) * count
        lines.append(f"| {name} | {median * 1e3:.1f} | {base / median:.2f}x | {moved / median / 1e9:.1f} |")
    threads = torch.get_num_threads() if not cuda else "-"
    title = (
        f"Optimizer step alone: AdamW on {count / 1e6:.1f}M parameters in {args.tensors} tensors, "
        f"{args.rounds} interleaved rounds, torch threads {threads}"
    )
    report(title, "\n".join(lines), args.device, args.record)


if __name__ == "__main__":
    main()
