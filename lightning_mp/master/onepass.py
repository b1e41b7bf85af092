"""The one-pass update of lean master weights: join, the optimizer's arithmetic and split in one compiled loop.

For ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (the optimizers :func:`~lightning_mp.master.step.uses_fused_kernel`
accepts), each element's bf16 weight, int16 remainder, gradient and optimizer state are read once and written once,
by one kernel call per param group: on the CPU the C kernel of :mod:`lightning_mp.master.native` (compiled on first
use, spread over ``torch.get_num_threads()`` threads), on CUDA the Triton kernel of
:mod:`lightning_mp.master.native.cuda`. The chunked path of :mod:`lightning_mp.master.step` (join into an fp32
buffer, torch's fused kernel, split back: about ten passes) remains the fallback, taken when the kernel cannot be
built (one warning), on other devices, and for deferred clipping it does not express (see :func:`plan_grad_ops`).

Exactness, on every device (:mod:`lightning_mp.master.native.contract`): the fp32 master values stay exact (the join
and split are lossless), and each value the update writes is as close to a float64 evaluation of the optimizer's
formula as torch's own fused kernel's on the same device.

- CPU: each element's update is the IEEE operations of torch's fused CPU kernel in its order, including the fused
  multiply-adds that torch's compiler formed (in the vector body and in the scalar tail of each tensor, the last
  ``numel % 8`` elements, which differ), so the result is bitwise ``torch.optim.AdamW/Adam/SGD(fused=True)`` on the
  joined fp32 values, for every flag (tests/test_onepass.py checks each against torch's kernel).
- CUDA (the default there; ``LIGHTNING_MP_CUDA_ONE_PASS=0`` turns it off): the Triton kernel keeps every
  intermediate in fp64 and rounds each stored value once, so each value is the float64 evaluation correctly rounded,
  where torch's CUDA kernel can be hundreds of ulp away on the same inputs (cancellation in its fp32 variables;
  measured in benchmarks/RESULTS.md). Its results are therefore not bitwise torch's; torch's CUDA
  kernel's are not bitwise its own CPU kernel's either. The chunked path (torch's CUDA kernel on joined fp32 chunks)
  stays the fallback where Triton is missing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Adam, Optimizer

from lightning_mp.master import native
from lightning_mp.master.step import _state_for, fp32_zeros_like, local_of


def plan_grad_ops(
    grad_ops: list[tuple[str, Any]], device: torch.device
) -> Optional[tuple[Optional[Tensor], Optional[float]]]:
    """``(factor, clamp)`` for the kernel: at most one clip-by-norm factor (a 0-dim fp32 tensor on ``device``), then
    at most one clip-by-value bound (the order Lightning applies them); ``None`` for anything else (the chunked path
    applies it)."""
    factor: Optional[Tensor] = None
    clamp: Optional[float] = None
    for kind, value in grad_ops:
        if kind == "mul" and factor is None and clamp is None:
            factor = value.detach().to(device, torch.float32).reshape(()).contiguous()
        elif kind == "clamp" and clamp is None:
            clamp = float(value)
        else:
            return None
    return factor, clamp


def plan(params: list[Tensor], grad_ops: list[tuple[str, Any]]) -> Optional[tuple[Optional[Tensor], Optional[float]]]:
    """The clipping the one-pass kernel applies to a group of ``params`` (:func:`plan_grad_ops`), or ``None`` when
    the kernel cannot update it (the chunked path does)."""
    if not params or not native.enabled():
        return None
    device = local_of(params[0]).device
    if any(local_of(p).device != device for p in params):
        return None
    if device.type == "cpu":
        built = native.cpu_kernel() is not None
    else:  # CUDA: the Triton kernel, unless LIGHTNING_MP_CUDA_ONE_PASS=0 (module doc)
        built = device.type == "cuda" and native.cuda_one_pass() and native.cuda_kernel() is not None
    return plan_grad_ops(grad_ops, device) if built else None


def update(
    optimizer: Optimizer,
    group: dict[str, Any],
    store: Any,
    clipping: tuple[Optional[Tensor], Optional[float]],
    found: Optional[Tensor],
) -> None:
    """One step of ``group`` on the lean state (weights with a remainder), in one pass; fp32 parameters of the group
    (no remainder) go through torch's own fused kernel in place. ``clipping``: :func:`plan`'s; ``found``: a 0-dim
    fp32 tensor on the parameters' device, or ``None``."""
    stepped = [p for p in group["params"] if p.grad is not None]
    if not stepped:
        return
    factor, clamp = clipping
    lean = [p for p in stepped if store.offset_of(p) is not None]
    plain = [p for p in stepped if store.offset_of(p) is None]
    if isinstance(optimizer, Adam):
        amsgrad = group["amsgrad"]
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
        states = [_state_for(optimizer, p, keys) for p in stepped]
        steps = [s["step"] for s in states]
        torch._foreach_add_(steps, 1)
        decoupled = bool(group.get("decoupled_weight_decay", False))
        options = dict(
            kind=native.ADAMW if decoupled else native.ADAM,
            amsgrad=bool(amsgrad),
            maximize=bool(group["maximize"]),
            lr=float(group["lr"]),
            beta1=float(group["betas"][0]),
            beta2=float(group["betas"][1]),
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
        )
        by_param = dict(zip(map(id, stepped), states))
        rows = [(p, [local_of(by_param[id(p)][key]) for key in keys], by_param[id(p)]["step"]) for p in lean]
        _run(store, group, rows, options, factor, clamp, found)
        if plain:
            _plain_adam(group, plain, [by_param[id(p)] for p in plain], found, decoupled)
        if found is not None:
            torch._foreach_sub_(steps, [found] * len(steps))
        return
    momentum = group["momentum"]
    first_step = momentum != 0 and all(optimizer.state[p].get("momentum_buffer") is None for p in stepped)
    if momentum != 0:
        for param in stepped:
            if optimizer.state[param].get("momentum_buffer") is None:
                # zeros, not torch's empty_like: a first step skipped by found leaves defined values behind
                optimizer.state[param]["momentum_buffer"] = fp32_zeros_like(param)
    options = dict(
        kind=native.SGD,
        maximize=bool(group["maximize"]),
        nesterov=bool(group["nesterov"]),
        first_step=bool(first_step),
        lr=float(group["lr"]),
        weight_decay=float(group["weight_decay"]),
        momentum=float(momentum),
        dampening=float(group["dampening"]),
    )
    buffers = (lambda p: [local_of(optimizer.state[p]["momentum_buffer"])]) if momentum != 0 else (lambda p: [])
    _run(store, group, [(p, buffers(p), None) for p in lean], options, factor, clamp, found)
    if plain:
        torch._fused_sgd_(
            [local_of(p).detach() for p in plain],
            [local_of(p.grad) for p in plain],
            [local_of(optimizer.state[p]["momentum_buffer"]) for p in plain] if momentum != 0 else [],
            weight_decay=group["weight_decay"],
            momentum=momentum,
            lr=float(group["lr"]),
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            is_first_step=first_step,
            grad_scale=None,
            found_inf=found,
        )


def _run(
    store: Any,
    group: dict[str, Any],
    rows: list[tuple[Tensor, list[Tensor], Optional[Tensor]]],
    options: dict[str, Any],
    factor: Optional[Tensor],
    clamp: Optional[float],
    found: Optional[Tensor],
) -> None:
    """The kernel over ``rows`` (parameter, its state tensors, its step count), one call per gradient dtype."""
    by_dtype: dict[torch.dtype, list[Any]] = {}
    for row in rows:
        by_dtype.setdefault(local_of(row[0].grad).dtype, []).append(row)
    options = {**options, "clamped": clamp is not None, "clamp": clamp if clamp is not None else -1.0}
    for dtype, chosen in by_dtype.items():
        keep = []  # gradients made contiguous: referenced here until the kernel has read them
        addresses = []
        for param, states, _ in chosen:
            local = local_of(param)
            offset = store.offset_of(param)
            high, low = store.flat_slices(local.device, offset, offset + local.numel())
            grad = local_of(param.grad).detach()
            if not grad.is_contiguous():
                grad = grad.contiguous()
                keep.append(grad)
            pointers = [t.data_ptr() for t in states] + [0] * (3 - len(states))
            addresses.append([high.data_ptr(), low.data_ptr(), grad.data_ptr(), *pointers, local.numel()])
        steps = [row[2] for row in chosen] if chosen[0][2] is not None else None
        device = local_of(chosen[0][0]).device
        grad_fp32 = dtype == torch.float32
        these = {**options, "grad_fp32": grad_fp32}
        if device.type == "cpu":
            native.run_rows(addresses, steps, these, factor, found)
        else:
            native.cuda_update(store).run(id(group) * 2 + grad_fp32, addresses, steps, these, found, factor, device)


def _plain_adam(
    group: dict[str, Any], params: list[Tensor], states: list[dict[str, Any]], found: Optional[Tensor], decoupled: bool
) -> None:
    """fp32 parameters (kept in fp32 by the policy): torch's fused kernel on them, in place."""
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        [local_of(p).detach() for p in params],
        [local_of(p.grad) for p in params],
        [local_of(s["exp_avg"]) for s in states],
        [local_of(s["exp_avg_sq"]) for s in states],
        [local_of(s["max_exp_avg_sq"]) for s in states] if group["amsgrad"] else [],
        [s["step"] for s in states],
        amsgrad=group["amsgrad"],
        lr=float(group["lr"]),
        beta1=float(group["betas"][0]),
        beta2=float(group["betas"][1]),
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
        grad_scale=None,
        found_inf=found,
    )
