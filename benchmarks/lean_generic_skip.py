"""The generic lean-masters step (any optimizer): deciding a skip on the host against masking it on the device.

    python benchmarks/lean_generic_skip.py                       # 4M parameters, CUDA if present, else CPU
    python benchmarks/lean_generic_skip.py --params 1 --record   # 1M parameters; append the table to HISTORY.md

``master_weights="remainder"`` with an optimizer that is not torch's AdamW/Adam/SGD runs its ``step()`` on fp32
slices, chunk by chunk (:mod:`lightning_mp.master.lean.generic`). With a found-inf flag it either reads the flag on the
host (one synchronisation, then the plain step: ``host``), or masks each chunk's write-back on the device (copies of
the chunk's optimizer state and fp32 values before, ``torch.where`` after: ``device``, finite flag; ``device, skip``,
a nonzero flag). Options are interleaved round by round (every option once per round, the median over rounds is
shown) on one model (bf16 linears, fp32 norms); on a CPU the host read costs nothing, so the table shows the price of
the masking, which on a GPU buys the removed synchronisation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import report  # noqa: E402

from lightning_mp.master import RemainderMasters  # noqa: E402


class SubclassedSGD(torch.optim.SGD):
    """Not exactly torch.optim.SGD: the generic path."""


def _optimizers(device: str) -> dict[str, Callable[..., torch.optim.Optimizer]]:
    # on a GPU, torch's RMSprop keeps its step count on the GPU only with capturable=True (else on the CPU, and then
    # the plugin reads the flag on the host: the table says which options were masked on the device)
    capturable = device == "cuda"
    makers: dict[str, Callable[..., torch.optim.Optimizer]] = {
        "RMSprop(momentum, centered)": lambda ps: torch.optim.RMSprop(
            ps, lr=1e-4, momentum=0.9, centered=True, capturable=capturable
        ),
        "SGD subclass (momentum)": lambda ps: SubclassedSGD(ps, lr=1e-3, momentum=0.9),
    }
    try:
        import optimi

        makers["optimi AdamW"] = lambda ps: optimi.AdamW(ps, lr=1e-4)
    except ImportError:
        pass
    return makers


def _model(params_m: float, device: str) -> nn.Module:
    width = int((params_m * 1e6 / 4) ** 0.5)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers).to(device)


def _time(fn: Callable[[], Any], device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _options(store: RemainderMasters, optimizer: Any, zero: torch.Tensor, one: torch.Tensor) -> dict[str, Any]:
    return {
        "host": lambda: store.fused_step(optimizer, None),
        "device": lambda: store.fused_step(optimizer, zero),
        "device, skip": lambda: store.fused_step(optimizer, one),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=4.0, help="millions of parameters")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/HISTORY.md")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, make in _optimizers(args.device).items():
        model = _model(args.params, args.device)
        store = RemainderMasters()
        store.convert(model)
        optimizer = make(model.parameters())
        store.attach([optimizer])
        for param in model.parameters():
            param.grad = torch.randn_like(param) * 1e-3
        zero = torch.zeros((), device=args.device)
        one = torch.ones((), device=args.device)
        store.fused_step(optimizer, None)  # the state exists
        store.fused_step(optimizer, zero)  # the host reads the flag once more and learns whether it can mask
        masked = "yes" if store.updates.of(optimizer).generic.masks_on_device else "no (host read)"
        options = _options(store, optimizer, zero, one)
        times: dict[str, list[float]] = {option: [] for option in options}
        for round_ in range(args.warmup + args.rounds):
            for option, run in options.items():
                elapsed = _time(run, args.device)
                if round_ >= args.warmup:
                    times[option].append(elapsed)
        host = statistics.median(times["host"])
        for option, values in times.items():
            median = statistics.median(values)
            on_device = masked if option != "host" else "-"
            rows.append(f"| {name} | {option} | {on_device} | {1e3 * median:.2f} | {median / host:.2f}x |")
    params = sum(p.numel() for p in _model(args.params, "cpu").parameters())
    table = (
        f"{params / 1e6:.2f}M parameters (4 bf16 linears, 4 fp32 LayerNorms), default chunk size; median over "
        f"{args.rounds} rounds, options interleaved.\n\n"
        "| optimizer | flag given as | masked on the device | step ms | vs host |\n|---|---|---|---:|---:|\n"
        + "\n".join(rows)
    )
    report("Generic lean step: skip on the host vs masked on the device", table, args.device, args.record)


if __name__ == "__main__":
    main()
