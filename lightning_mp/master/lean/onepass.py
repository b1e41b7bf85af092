"""The one-pass update of lean master weights: join, the optimizer's arithmetic and split in one compiled loop.

For ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (the entries of :mod:`~lightning_mp.master.lean.optimizers` that have
a kernel), each element's bf16 weight, int16 remainder, gradient and optimizer state are read once and written once,
by one kernel call per param group: on the CPU the C kernel of :mod:`lightning_mp.kernels.native` (compiled on first
use, spread over ``torch.get_num_threads()`` threads), on CUDA the Triton kernel of
:mod:`lightning_mp.kernels.cuda` (one launch per gradient dtype). What a group's call reads is laid out once, in
its step plan (:mod:`lightning_mp.master.lean.plan`), and replayed each step; the step inside backward replays one plan
per parameter. The chunked path of :mod:`lightning_mp.master.lean.chunked` (join into an fp32
buffer, torch's fused kernel, split back: about ten passes) remains the fallback, taken when the kernel cannot be
built (one warning), on other devices, and for deferred clipping it does not express (see :func:`plan_grad_ops`).

Exactness, on every device (:mod:`lightning_mp.kernels.contract`): the fp32 master values stay exact (the join
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
from torch.optim import Optimizer

from lightning_mp.kernels import native
from lightning_mp.master.lean.optimizers import Entry, local_of
from lightning_mp.master.lean.plan import Plans, Stale, StepPlan


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


def expressible(grad_ops: list[tuple[str, Any]]) -> bool:
    """Whether the kernel applies ``grad_ops`` itself (:func:`plan_grad_ops` gives a plan), without making any
    tensor: at most one clip-by-norm factor, then at most one clip-by-value bound."""
    kinds = [kind for kind, _ in grad_ops]
    return kinds in ([], ["mul"], ["clamp"], ["mul", "clamp"])


def ready(
    optimizer: Optimizer,
    group: dict[str, Any],
    plans: Plans,
    store: Any,
    grad_ops: list[tuple[str, Any]],
    param: Any = None,
) -> Any:
    """The plan among ``plans`` (the store's) that :func:`run` will replay for ``group`` (or, with ``param``, that parameter's), when it exists,
    still fits (:meth:`~lightning_mp.master.lean.plan.StepPlan.fits`), no parameter of it gained a gradient and the
    kernel takes the clipping; else ``None``: that step lays out a plan (or takes the chunked path) and may refuse
    state it meets, so a caller checks every state first (:func:`~lightning_mp.master.lean.chunked.check_states`) to refuse
    before any update. Pass what it returns to :func:`run` as ``ready``: the plan is not checked twice."""
    key, owner, params = (id(group), group, group["params"]) if param is None else (id(param), param, [param])
    made = plans.get(key)
    if (
        made is None
        or made.owner_object is not owner
        or made.kernel is None
        or not made.fits(optimizer, group, store, params)
        or any(p.grad is not None for p in made.idle)
        or (grad_ops and not expressible(grad_ops))
    ):
        return None
    return made


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


def run(
    optimizer: Optimizer,
    entry: Entry,
    group: dict[str, Any],
    plans: Plans,
    store: Any,
    grad_ops: list[tuple[str, Any]],
    found: Optional[Tensor],
    param: Optional[Tensor] = None,
    ready: Any = None,
) -> bool:
    """One step of ``group`` (or, with ``param``, of that one parameter of it: the step inside backward) on the lean
    state, in one pass, by its :class:`~lightning_mp.master.lean.plan.StepPlan` (made on the first step and whenever it
    no longer fits); fp32 parameters (no remainder) go through torch's own fused kernel in place. ``found``: a 0-dim
    fp32 tensor on the parameters' device, or ``None``. ``False`` (nothing done): the chunked path must take it (no
    kernel for these parameters, clipping the kernel does not express, gradients neither bf16 nor fp32)."""
    key, params, owner = (id(group), group["params"], group) if param is None else (id(param), [param], param)
    made = ready
    if made is None:
        made = plans.get(key)
        if made is None or made.owner_object is not owner or not made.fits(optimizer, group, store, params):
            made = _replan(plans, optimizer, entry, group, params, store, key, owner)
    if made.kernel is None:
        return False
    clipping = plan_grad_ops(grad_ops, made.device) if grad_ops else (None, None)
    if clipping is None:
        return False
    try:
        return made.run(group, clipping[0], clipping[1], found)
    except Stale:  # a gradient appeared or went away since the plan was made
        made = _replan(plans, optimizer, entry, group, params, store, key, owner)
        return made.run(group, clipping[0], clipping[1], found)


def _replan(
    plans: Plans,
    optimizer: Optimizer,
    entry: Entry,
    group: dict[str, Any],
    params: list[Tensor],
    store: Any,
    key: int,
    owner: Any,
) -> StepPlan:
    """A new plan under ``key``; plans that describe nothing any more are released with their tensors: those of a
    dead optimizer, of one whose state was replaced (a resume), of a group no longer in its ``param_groups``."""
    plans.pop(key, None)
    groups = optimizer.param_groups
    for old in [k for k, p in plans.items() if not p.current(optimizer, groups)]:
        del plans[old]
    # the plan of ``params``: with the compiled kernel of their device where :func:`plan` finds one
    made = plans[key] = StepPlan(optimizer, entry, group, list(params), store, _kernel_for(params), key, owner)
    return made


def _kernel_for(params: list[Tensor]) -> Optional[str]:
    """``"cpu"`` (the C kernel), ``"cuda"`` (the Triton kernel) or ``None`` (the chunked path) for ``params``."""
    if plan(params, []) is None:
        return None
    return "cpu" if local_of(params[0]).device.type == "cpu" else "cuda"
