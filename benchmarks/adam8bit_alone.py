"""The optimizer update alone, 8-bit Adam on lean masters against the others: wall time per update.

    python benchmarks/adam8bit_alone.py [--tensors 32] [--numel 524288] [--steps 10] [--rounds 5] [--threads 2]
        [--device cpu|cuda] [--modes MODE ...] [--start-step 20000]
    python benchmarks/adam8bit_alone.py --device cuda --tune [--best FILE]

On CUDA (``--device cuda``) every update is timed up to a ``torch.cuda.synchronize()`` and ``lean AdamW8bit`` is the
Triton kernel's step (``kernels/cuda_adam8bit.py``); the ``kernel alone`` mode is the C kernel's and is left out.

Each mode updates ``--tensors`` parameters of ``--numel`` values (16.8M by default) with AdamW (lr 1e-3, weight decay
0.01) from gradients made once (bf16 where the weights are 16-bit, fp32 otherwise); the modes take turns, round by
round, in one process (the first step of each round is not counted), and the table gives the median over rounds of
each round's median update (wall time: the kernels run on ``--threads`` threads).

- ``torch AdamW(fused), fp32``: the built-in's update (fp32 weights, fp32 state): 28 bytes moved per parameter;
- ``torch AdamW(fused), bf16``: ``bf16-true``'s (bf16 weights and state: lossy);
- ``torchao AdamW8bit, fp32``: torchao's compiled 8-bit step on fp32 weights (the built-in with AdamW8bit);
- ``lean AdamW``: ``master_weights="remainder"``'s one-pass update (``RemainderMasters.fused_step``);
- ``lean AdamW8bit``: ``master_weights="remainder"`` with torchao's AdamW8bit, the lean store's step
  (``RemainderMasters.fused_step``: the one-pass 8-bit step of ``master/lean/eightbit.py``, a replayed layout);
- ``lean AdamW8bit, generic``: the same with a subclass of AdamW8bit, which takes the generic path (fp32 chunks
  joined, torchao's compiled step, split back): what AdamW8bit ran before issue 54;
- ``lean AdamW8bit, kernel alone``: the one-pass 8-bit kernel (``lightning_mp.kernels.adam8bit``) called directly on
  the bf16 weights, int16 remainders and torchao's 8-bit state: the same bits as torchao's step
  (``tests/test_lean_adam8bit.py``).

``--tune`` (CUDA): the Triton kernel's update under each launch shape (``LIGHTNING_MP_TRITON_8BIT_CONFIG=TILE,WARPS``,
:data:`TILES` x :data:`WARPS`), the shapes and torch's fused fp32 AdamW taking turns, and ``--best FILE`` gets the
fastest shape (``export LIGHTNING_MP_TRITON_8BIT_CONFIG=$(cat FILE)``). Every shape gives the same bits
(``tests/test_cuda_adam8bit.py``).

Time nothing beside another job: on 2 cores a second OpenMP job makes every figure many times worse.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from lightning_mp.kernels import adam8bit
from lightning_mp.kernels.bits import split_fp32
from lightning_mp.master import RemainderMasters

MODES = (
    "torch AdamW(fused), fp32",
    "torch AdamW(fused), bf16",
    "torchao AdamW8bit, fp32",
    "lean AdamW",
    "lean AdamW8bit",
    "lean AdamW8bit, generic",
    "lean AdamW8bit, kernel alone",
)
OPTIONS = dict(lr=1e-3, weight_decay=0.01)
#: the launch shapes ``--tune`` times: elements per program, warps per program
TILES = (512, 1024, 2048, 4096, 8192)
WARPS = (1, 2, 4, 8)


def _weights(tensors: int, numel: int, dtype: torch.dtype, device: str = "cpu") -> nn.ParameterList:
    generator = torch.Generator().manual_seed(0)
    return nn.ParameterList(
        [
            nn.Parameter((torch.randn(numel, generator=generator) * 0.02).to(device=device, dtype=dtype))
            for _ in range(tensors)
        ]
    )


def _grads(params: nn.ParameterList, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    for param in params:
        param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(device=param.device, dtype=dtype)


def make_modes(
    tensors: int, numel: int, device: str = "cpu", names: Sequence[str] = MODES, start_step: int = 0
) -> dict[str, Callable[[], None]]:
    """Each mode of ``names`` with its update set up on ``device`` (state made by a first step; with ``start_step``,
    every state's step count then set to it: the update as it runs that far into training)."""
    from torchao.optim import AdamW8bit

    modes: dict[str, Callable[[], None]] = {}
    optimizers: list[torch.optim.Optimizer] = []
    for name, dtype in (("torch AdamW(fused), fp32", torch.float32), ("torch AdamW(fused), bf16", torch.bfloat16)):
        if name in names:
            params = _weights(tensors, numel, dtype, device)
            _grads(params, dtype)
            optimizers.append(torch.optim.AdamW(params, fused=True, **OPTIONS))
            modes[name] = optimizers[-1].step
    if "torchao AdamW8bit, fp32" in names:
        params = _weights(tensors, numel, torch.float32, device)
        _grads(params, torch.float32)
        optimizers.append(AdamW8bit(params, **OPTIONS))
        modes["torchao AdamW8bit, fp32"] = optimizers[-1].step

    class SubclassedAdamW8bit(AdamW8bit):  # the generic path (the one-pass 8-bit step takes the exact class)
        pass

    lean = (("lean AdamW", torch.optim.AdamW), ("lean AdamW8bit", AdamW8bit))
    for name, make in (*lean, ("lean AdamW8bit, generic", SubclassedAdamW8bit)):
        if name not in names:
            continue
        module = _weights(tensors, numel, torch.float32, device)
        store = RemainderMasters()
        store.convert(module)
        optimizer = make(module.parameters(), **OPTIONS)
        optimizers.append(optimizer)
        store.attach([optimizer])
        _grads(module, torch.bfloat16)
        modes[name] = lambda store=store, optimizer=optimizer: store.fused_step(optimizer, None)
    # the one-pass 8-bit kernel on lean weights and torchao's state (made by one torchao step on fp32 copies)
    if "lean AdamW8bit, kernel alone" not in names or device != "cpu":
        return _made(modes, optimizers, start_step)
    fp32 = _weights(tensors, numel, torch.float32)
    _grads(fp32, torch.float32)
    reference = AdamW8bit(fp32, **OPTIONS)
    optimizers.append(reference)  # its state's step counts are the pieces' own
    reference.step()
    pieces = []
    for param in fp32:
        high, low = split_fp32(param.detach())
        state = reference.state[param]
        grad = param.grad.to(torch.bfloat16)
        pieces.append(adam8bit.Adam8bitPiece(high, low, grad, state["exp_avg"], state["exp_avg_sq"], state["step"]))
    lr = reference.param_groups[0]["lr"]
    modes["lean AdamW8bit, kernel alone"] = lambda: adam8bit.adam8bit_step_pieces(
        pieces, lr=lr, weight_decay=OPTIONS["weight_decay"]
    )
    return _made(modes, optimizers, start_step)


def _made(
    modes: dict[str, Callable[[], None]], optimizers: list[torch.optim.Optimizer], start_step: int
) -> dict[str, Callable[[], None]]:
    for update in modes.values():  # the state made, kernels built and compiled
        update()
    if start_step:
        for optimizer in optimizers:
            for state in optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].fill_(start_step)
    return modes


def measure(modes: dict[str, Callable[[], None]], steps: int, rounds: int, device: str = "cpu") -> dict[str, float]:
    """Median over rounds of each round's median update, in ms; the modes take turns within each round (on CUDA each
    update timed up to a synchronisation)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    medians: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(rounds):
        for name, update in modes.items():
            update()  # not counted
            times = []
            for _ in range(steps):
                sync()
                start = time.perf_counter()
                update()
                sync()
                times.append((time.perf_counter() - start) * 1e3)
            medians[name].append(statistics.median(times))
    return {name: statistics.median(values) for name, values in medians.items()}


def tune(tensors: int, numel: int, steps: int, rounds: int) -> dict[str, float]:
    """On CUDA: the lean AdamW8bit update (the Triton kernel) under each launch shape ``TILE,WARPS``, and torch's fused
    fp32 AdamW; ms per update by :func:`measure`, keyed by the shape (and the mode's name for the fused one)."""
    from lightning_mp.kernels import cuda_adam8bit

    modes = make_modes(tensors, numel, "cuda", ["torch AdamW(fused), fp32"])
    previous = os.environ.get(cuda_adam8bit.CONFIG_VARIABLE)
    try:
        for tile in TILES:
            for warps in WARPS:
                os.environ[cuda_adam8bit.CONFIG_VARIABLE] = f"{tile},{warps}"  # read when the layout is made
                modes[f"{tile},{warps}"] = make_modes(tensors, numel, "cuda", ["lean AdamW8bit"])["lean AdamW8bit"]
    finally:
        if previous is None:
            os.environ.pop(cuda_adam8bit.CONFIG_VARIABLE, None)
        else:
            os.environ[cuda_adam8bit.CONFIG_VARIABLE] = previous
    return measure(modes, steps, rounds, "cuda")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=32)
    parser.add_argument("--numel", type=int, default=1 << 19)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument(
        "--start-step",
        type=int,
        default=0,
        help="every optimizer's step count set to this after the first update: the update that far into training "
        "(from about 17,300 on with beta2 0.999, sqrt(1 - beta2**step) is 1 in fp32)",
    )
    parser.add_argument("--tune", action="store_true", help="CUDA: time the Triton kernel's launch shapes")
    parser.add_argument("--best", help="with --tune: write the fastest shape (TILE,WARPS) to this file")
    args = parser.parse_args()
    if args.tune and args.device != "cuda":
        parser.error("--tune times the Triton kernel's launch shapes: it needs --device cuda")
    if args.best and not args.tune:
        parser.error("--best is written by --tune")
    if args.tune:
        torch.set_num_threads(args.threads)
        result = tune(args.tensors, args.numel, args.steps, args.rounds)
        fused = result.pop("torch AdamW(fused), fp32")
        best = min(result, key=result.__getitem__)
        print(f"{args.tensors} x {args.numel} = {args.tensors * args.numel / 1e6:.1f}M parameters, "
              f"{torch.cuda.get_device_name()}; torch AdamW(fused), fp32: {fused:.3f} ms")  # fmt: skip
        print("| TILE,WARPS | lean AdamW8bit update (ms) | vs torch AdamW(fused), fp32 |")
        print("|---|---:|---:|")
        for shape, ms in result.items():
            print(f"| {shape}{' (fastest)' if shape == best else ''} | {ms:.3f} | {ms / fused:.2f}x |")
        if args.best:
            Path(args.best).write_text(best + "\n")
        return
    if args.start_step < 0:
        parser.error(f"--start-step must be 0 or more, not {args.start_step}")
    if "torch AdamW(fused), fp32" not in args.modes:
        parser.error("--modes must include 'torch AdamW(fused), fp32' (the table's reference)")
    torch.set_num_threads(args.threads)
    modes = make_modes(args.tensors, args.numel, args.device, args.modes, args.start_step)
    result = measure(modes, args.steps, args.rounds, args.device)
    fused = result["torch AdamW(fused), fp32"]
    where = f"{args.threads} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    start = f", from step {args.start_step}" if args.start_step else ""
    print(f"{args.tensors} x {args.numel} = {args.tensors * args.numel / 1e6:.1f}M parameters, {where}{start}")
    print("| mode | update (ms) | vs torch AdamW(fused), fp32 |")
    print("|---|---:|---:|")
    for name in MODES:
        if name in result:
            print(f"| {name} | {result[name]:.1f} | {result[name] / fused:.2f}x |")


if __name__ == "__main__":
    main()
