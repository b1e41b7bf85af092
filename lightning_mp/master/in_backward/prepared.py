"""The hooks' fast path: each parameter's one-pass call prepared once, then replayed with only its gradient's address.

Inside backward each hook updates one parameter by its one-parameter step plan (:mod:`lightning_mp.master.lean.plan`).
The plan's replay re-reads, per call, what can change between steps (:meth:`StepPlan.fits
<lightning_mp.master.lean.plan.StepPlan.fits>`: the optimizer state, the store's layout, the parameter's state dict
and tensors), builds the kernel's options from the group and its arguments, and the flag check is a call of its own;
a parameter kept in fp32 (a norm's) takes torch's fused kernel, an op of its own per parameter: together about 40 us
of Python per parameter, several times what the normal step spends per tensor.

:class:`Prepared` keeps, per parameter whose plan the CPU kernel ran, one :class:`~lightning_mp.kernels.native.Call`:
the plan's piece, step count, the parameter's flag slot and its group's options laid out once, so that a hook writes
the gradient's address and makes one C call, which checks the gradient for inf/NaN into the slot (as the separate
check does) and runs the step (skipped where the slot is 1), the step count settled after it, as the plan's replay.
The results are the plan's bit for bit: the same kernel on the same addresses with the same options. A parameter
kept in fp32 gets a piece of its own without a remainder: the kernel updates its fp32 values in place with the
arithmetic of torch's fused CPU kernel, which the kernel reproduces bit for bit (tests/test_onepass.py), its address
compared per call (``p.data = ...`` swaps it: the plan's way then); not under clipping, where the plan's way clips
its gradient in place first.

What :meth:`StepPlan.fits` checks per call is checked once per backward instead, before any hook runs: the
step inside backward compares the state of all its parameters before each backward
(:class:`~lightning_mp.master.lean.plan.StateSeen`, which checks every state and refuses before any update where
something changed) and its param groups; where either changed, or the store's layout did, every prepared call is
dropped (:meth:`Prepared.clear`) and the next hooks go the plan's way, preparing their calls again. The group options
(an LR scheduler's) are read once per group per backward (:meth:`Prepared.begin`) into the options the calls point
at, rewritten in place. Per call only what a gradient brings is compared: its dtype, device and contiguity; anything
else (a plan that is not one lean parameter on the CPU, clipping by norm, FSDP2's agreed flags) takes the plan's way.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mp.kernels import native
from lightning_mp.master.lean.plan import kernel_options, kernel_values

_GRAD_DTYPES = (torch.bfloat16, torch.float32)


class Prepared:
    """The prepared calls of one :class:`~lightning_mp.master.in_backward.StepInBackward` (module doc).

    Args:
        update: its :class:`~lightning_mp.master.lean.update.LeanUpdate`.
    """

    def __init__(self, update: Any) -> None:
        self.update = update
        #: id(param) -> (its call, the gradient dtype it was prepared for, a kept-fp32 parameter's address or None,
        #: what the call's addresses point into: held as long as the call is)
        self.calls: dict[int, tuple[native.Call, torch.dtype, Optional[int], Any]] = {}
        self.options: dict[int, native.Options] = {}  # group index -> the options every call of the group points at
        self.values: dict[int, tuple[Any, ...]] = {}  # group index -> what its options were made of
        self.groups: dict[int, dict[str, Any]] = {}  # group index -> one of its one-parameter groups
        self.active = False  # whether this backward's hooks may take the prepared calls
        self.clamp: Optional[float] = None
        self.layout_version: Any = None
        self.library: Any = None

    def clear(self) -> None:
        """Drop every prepared call (the state, the param groups or the store's layout changed)."""
        self.calls = {}

    def begin(self, ones: dict[int, tuple[int, dict[str, Any]]], grad_ops: list[tuple[str, Any]], agreed: bool) -> None:
        """Before backward, after the state and the groups were checked: whether this backward's hooks take the
        prepared calls (not with clipping other than by value, nor with flags agreed per parameter across ranks);
        each group's options read once (``ones``: ``id(param) -> (group index, its one-parameter group)``)."""
        update = self.update
        store = update.store
        self.active = False
        if update.generic is not None or update.entry is None or update.entry.kernel is None or agreed:
            return
        if [kind for kind, _ in grad_ops] not in ([], ["clamp"]):
            return
        self.library = native.cpu_kernel() if native.enabled() else None
        if self.library is None:
            return
        layout_version = getattr(store, "layout_version", 0)
        if layout_version != self.layout_version:
            self.calls, self.layout_version = {}, layout_version
        if not self.groups:
            for index, one in ones.values():
                self.groups.setdefault(index, one)
        clamp = self.clamp = float(grad_ops[0][1]) if grad_ops else None
        for index, one in self.groups.items():
            values = kernel_values(update.entry, one, False, None, clamp)
            if values == self.values.get(index):
                continue
            options = kernel_options(values)
            held = self.options.get(index)
            if held is None:
                self.options[index] = options
            else:  # rewritten in place: every prepared call of the group points at it
                ctypes.memmove(ctypes.addressof(held), ctypes.addressof(options), ctypes.sizeof(options))
            self.values[index] = values
        self.active = True

    def forget_groups(self) -> None:
        """The param groups changed: calls, options and the groups' representatives are made again."""
        self.calls, self.options, self.values, self.groups = {}, {}, {}, {}

    def run(self, param: Tensor) -> bool:
        """``param``'s check and update by its prepared call; ``False`` (nothing done) where it has none or its
        gradient (or, kept in fp32, its own storage) is not what the call was prepared for (the plan's way then)."""
        prepared = self.calls.get(id(param))
        if prepared is None:
            return False
        call, dtype, address, _ = prepared
        grad = param.grad
        if grad.dtype is not dtype or not grad.is_cpu or not grad.is_contiguous():
            return False
        if address is not None and param.data_ptr() != address:  # kept in fp32: its storage swapped (.data = ...)
            return False
        call.grad = grad.data_ptr()
        self.library.lean_step_call(call)
        return True

    def prepare(self, param: Tensor, index: int, found: Optional[Tensor]) -> None:
        """After ``param``'s update went the plan's way: its call prepared from the plan it ran (``index`` its
        group's, ``found`` its flag slot, checked by the call; ``None``: no check), where the plan is one parameter
        on the CPU kernel (lean, or kept in fp32 without clipping), else none."""
        self.calls.pop(id(param), None)
        if not self.active:
            return
        plan = self.update.store.step_plans.get(id(param))
        grad = param.grad
        options = self.options.get(index)
        if (
            plan is None
            or options is None
            or grad is None
            or plan.owner_object is not param
            or plan.kernel != "cpu"
            or plan.sharded
            or plan.first_step
            or plan.idle
            or plan.foreach_steps
            or grad.dtype not in _GRAD_DTYPES
            or not grad.is_cpu
            or (found is not None and (found.device.type != "cpu" or found.dtype != torch.float32))
        ):
            return
        check = grad.dtype if found is not None else None
        if plan.count == 1 and not plan.plain and plan.dtypes == [grad.dtype] and plan.pieces[0].n == grad.numel():
            call = native.prepare_call(
                plan.pieces, plan.flags, options, found, plan.counts, len(plan.steps), plan.first_unit, grad.numel(),
                check,
            )  # fmt: skip
            if call is not None:
                self.calls[id(param)] = (call, grad.dtype, None, (plan, found, options))  # what its addresses are in
            return
        if plan.count == 0 and plan.plain == [param] and self.clamp is None:
            self._prepare_fp32(param, grad, plan, options, found, check)

    def _prepare_fp32(self, param: Tensor, grad: Tensor, plan: Any, options: Any, found: Any, check: Any) -> None:
        """A parameter kept in fp32 (a norm's): the kernel updates its fp32 values in place (a piece without a
        remainder), the arithmetic of torch's fused kernel that the plan's way runs on it, bitwise."""
        states = [column[0] for column in plan.plain_states]
        numel = param.numel()
        tensors = [param, grad, *states]
        if (
            len(states) > 3
            or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in tensors)
            or any(t.numel() != numel for t in tensors)
        ):
            return
        steps = plan.plain_steps
        step = steps[0].data_ptr() if steps else None
        addresses = [t.data_ptr() for t in states] + [None] * (3 - len(states))
        pieces = (native.Piece * 1)(native.Piece(param.data_ptr(), None, None, *addresses, step, numel, 1))
        flags = (ctypes.c_byte * 1)(1)
        first_unit = (ctypes.c_int64 * 2)()
        call = native.prepare_call(
            pieces, flags, options, found, plan.counts, len(plan.steps), first_unit, numel, check
        )
        if call is not None:  # held: the arrays, the plan (its state tensors), the parameter's storage
            held = (plan, found, options, pieces, flags, first_unit, param.untyped_storage())
            self.calls[id(param)] = (call, grad.dtype, param.data_ptr(), held)
