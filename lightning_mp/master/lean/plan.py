"""The one-pass update of lean master weights: join, the optimizer's arithmetic and split in one compiled loop, by a
step plan per param group (:func:`run`).

For ``torch.optim.AdamW``, ``Adam`` and ``SGD`` (the entries of :mod:`~lightning_mp.master.lean.optimizers` that have
a kernel), each element's bf16 weight, int16 remainder, gradient and optimizer state are read once and written once,
by one kernel call per param group: on the CPU the C kernel of :mod:`lightning_mp.kernels.native` (compiled on first
use, spread over ``torch.get_num_threads()`` threads), on CUDA the Triton kernel of
:mod:`lightning_mp.kernels.cuda` (one launch per gradient dtype). What a group's call reads is laid out once, in
its step plan (below), and replayed each step; the step inside backward replays one plan
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

The step plan: what a param group's update reads, laid out once and replayed each step.

Between two steps almost nothing the update reads moves: the bf16 weights and remainders sit in the store's blocks,
the optimizer's state tensors stay where the first step made them, the group's parameters are the same. A
:class:`StepPlan` records all of it when a group (or, for the step inside backward, one parameter) is first stepped:
which parameters are lean (weight + remainder) and which are kept in fp32, every weight's, remainder's and state
tensor's address, the step counts, and the kernel's arguments (on the CPU the ctypes array of pieces; on CUDA the
flat address table the Triton kernel reads). A step then passes only what changes: the gradients' addresses (autograd
makes new gradients each step unless they are zeroed in place), their dtypes, the group's options (an LR scheduler
changes them), the clipping and the found-inf flag. No aten op is issued for the lean parameters on the CPU: the C
kernel advances their step counts itself (``step += 1``, then ``step -= found``, torch's two foreach ops in C).

A plan is a cache of what the update reads, so it is kept only while everything it read is still what torch's
optimizer would read now; otherwise it is rebuilt, never patched. It does not compare anything itself: it keeps the
optimizer's generation it was laid out at (:func:`lightning_mp.master.following.seen`, the one module that follows
the groups, their parameters and options, the state objects, values and addresses), and :meth:`StepPlan.fits` is
that generation and the store's ``layout_version`` (blocks made or released) being the same now.

Memory safety: the plan holds every tensor and storage whose address it hands the kernel (the block slices, the
state tensors, their storages), so an address it gives is always live memory; and it gives an address only after
checking that it is still where the tensor's data is, so a swapped storage is followed, never written through.
A parameter whose gradient appeared or went away is met while reading the gradients (:class:`Stale`).
Inside backward a plan of one parameter, once replayed, makes its fast form (:meth:`StepPlan.make_fast`): the same
call laid out as one C call that also checks the gradient, replayed by each hook with only the gradient's address. State that
the kernel cannot read (not fp32, another shape or device, not contiguous) is refused when the plan is laid out, by
name, before any update of the step.
"""

from __future__ import annotations

import ctypes
import weakref
from operator import attrgetter
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.kernels import native
from lightning_mp.master.lean.chunked import apply_grad_ops_in_place
from lightning_mp.master.lean.interface import LeanStore
from lightning_mp.master.lean.optimizers import Entry, local_of, state_for

_FP32 = torch.float32
_GRAD_DTYPES = (torch.bfloat16, torch.float32)
_GRAD = attrgetter("grad")
_DTYPE = attrgetter("dtype")


def _in_place(param: Tensor) -> bool:
    """Whether the CPU kernel can update the fp32 parameter ``param`` in place (a piece without a remainder)."""
    return param.dtype == _FP32 and param.device.type == "cpu" and param.is_contiguous()


class Plans(dict):
    """A store's plans by the id of their group (or parameter). A copy or a pickle of the store starts without any:
    ids and addresses belong to this process's objects (and ctypes arrays of addresses cannot be pickled)."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (Plans, ())


class Stale(Exception):
    """The parameters that have a gradient are no longer the plan's: build a new one."""


class StepPlan:
    """The one-pass update of ``params`` (a group's, or one parameter's) of ``optimizer`` on ``store``'s lean state.

    Args:
        entry: the optimizer's entry in the table (:mod:`.optimizers`): its state keys and kernel options.
        kernel: ``"cpu"`` (the C kernel), ``"cuda"`` (the Triton kernel) or ``None`` (no kernel for these
            parameters: the caller takes the chunked path).
        key: what the CUDA update's caches are kept under (the group's or the parameter's id).
        owner: the group dict (or, inside backward, the parameter) the plan is kept under by id: held, so that id
            cannot name another object while the plan lives.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        entry: Entry,
        group: dict[str, Any],
        params: list[Tensor],
        store: LeanStore,
        kernel: Optional[str],
        key: int,
        owner: Any,
        generation: int,
    ) -> None:
        self.entry = entry
        self.kernel = kernel
        self.key = key
        self.owner_object = owner
        self.optimizer = weakref.ref(optimizer)
        #: what the optimizer read when the plan was laid out (:func:`~lightning_mp.master.following.seen`'s
        #: ``state`` counter): the plan is replayed only while it is the optimizer's
        self.generation = generation
        self.owner = store  # the CUDA update's caches are the store's
        self.layout_version = store.layout_version
        self.params = list(params)
        self.device = local_of(params[0]).device if params else torch.device("cpu")
        self.sharded = any(local_of(p) is not p for p in params)  # DTensors: the local shards are read
        self._options: tuple[tuple[Any, ...], Any] = ((), None)
        #: inside backward, once replayed: the plan's fast form, one C call (:meth:`make_fast`)
        self.fast: Optional[tuple[native.Call, torch.dtype, Optional[int], Any]] = None
        if kernel is not None:
            self._lay_out(optimizer, group, self.params, store)

    def fits(self, generation: int, store: LeanStore) -> bool:
        """Whether everything the plan read is still what torch's optimizer would read now: ``generation`` (the
        optimizer's, as :func:`~lightning_mp.master.following.seen` answers now) is the plan's, and the store's
        blocks are the ones laid out."""
        return generation == self.generation and store.layout_version == self.layout_version

    # ------------------------------------------------------------------ built once
    def _lay_out(self, optimizer: Optimizer, group: dict[str, Any], params: list[Tensor], store: LeanStore) -> None:
        stepped = [p for p in params if p.grad is not None]
        self.idle = [p for p in params if p.grad is None]  # a gradient appearing here makes the plan stale
        store.check_trained(stepped)  # a parameter put in the group by hand must be one the store holds
        entry = self.entry
        adam = entry.counts_steps  # step counts advanced around the kernel (Adam's), or none (SGD's)
        keys = entry.keys(group)
        self.first_step = entry.first_step(optimizer, group, stepped)
        states = [state_for(entry, optimizer, p, group) for p in stepped]
        lean = [i for i, p in enumerate(stepped) if store.offset_of(p) is not None]
        plain = [i for i, p in enumerate(stepped) if store.offset_of(p) is None]
        # on the CPU the kernel updates fp32 parameters (a norm's, kept in fp32) in place too, a piece without a
        # remainder, with the arithmetic of torch's fused kernel that the plain path runs on them, bitwise
        in_place = [i for i in plain if self.kernel == "cpu" and not self.sharded and _in_place(stepped[i])]
        plain = [i for i in plain if i not in in_place]
        lean += in_place
        self.lean = [stepped[i] for i in lean]
        self.plain = [stepped[i] for i in plain]
        self.plain_locals = [local_of(p) for p in self.plain]
        self.plain_states = [[local_of(states[i][key]) for i in plain] for key in keys]
        self.steps = [s["step"] for s in states] if adam else []
        self.plain_steps = [states[i]["step"] for i in plain] if adam else []
        self.lean_steps = [states[i]["step"] for i in lean] if adam else None
        self.held: list[Any] = []  # the block slices, storages and state tensors whose addresses the kernel is given
        rows = []
        self.fp32_addresses: list[Optional[int]] = []  # per piece: the fp32 parameter's own address, or None
        for param, i in zip(self.lean, lean):
            local = local_of(param)
            offset = store.offset_of(param)
            tensors = [local_of(states[i][key]) for key in keys]
            addresses = [t.data_ptr() for t in tensors] + [0] * (3 - len(tensors))
            if offset is None:  # in place: its storage held, so its address cannot come back under another tensor
                self.held += [local.untyped_storage(), *tensors]
                self.fp32_addresses.append(local.data_ptr())
                rows.append([local.data_ptr(), 0, 0, *addresses, local.numel()])
                continue
            high, low = store.flat_slices(local.device, offset, offset + local.numel())
            self.held += [high, low, *tensors]
            self.fp32_addresses.append(None)
            rows.append([high.data_ptr(), low.data_ptr(), 0, *addresses, local.numel()])
        self.count = len(rows)
        self.dtypes: list[torch.dtype] = []
        self.pointers: list[int] = []
        if self.kernel == "cpu":
            self.library: Any = native.cpu_kernel()  # built: a plan gets the CPU kernel only where it is
            steps = self.lean_steps
            self.pieces = (native.Piece * len(rows))(
                *[
                    native.Piece(*(a or None for a in row[:6]), steps[k].data_ptr() if steps else None, row[6], 0)
                    for k, row in enumerate(rows)
                ]
            )
            self.first_unit = (ctypes.c_int64 * (len(rows) + 1))()
            self.flags = (ctypes.c_byte * len(rows))()
            counted = adam and all(s.device.type == "cpu" and s.dtype == _FP32 and s.dim() == 0 for s in self.steps)
            self.counts = (ctypes.c_void_p * len(self.steps))(*[s.data_ptr() for s in self.steps]) if counted else None
            self.foreach_steps = [] if counted else self.steps
        else:
            steps = self.lean_steps
            self.on_device = steps is not None and all(s.device == self.device and s.dtype == _FP32 for s in steps)
            step_addresses = [s.data_ptr() for s in steps] if steps is not None and self.on_device else [0] * len(rows)
            self.table = [value for row, step in zip(rows, step_addresses) for value in (*row, step)]
            self.numels = tuple(row[6] for row in rows)
            self.counts = None
            self.foreach_steps = self.plain_steps if self.on_device else self.steps  # the rest: the bias kernel's

    # ------------------------------------------------------------------ each step
    def run(
        self, group: dict[str, Any], factor: Optional[Tensor], clamp: Optional[float], found: Any, threads: int
    ) -> bool:
        """One update of the planned parameters on ``threads`` threads (the CPU kernel's); ``False`` (nothing done)
        where a gradient's dtype is neither bf16 nor fp32 (the chunked path takes it). Raises :class:`Stale` when the
        plan no longer fits."""
        for param in self.idle:
            if param.grad is not None:
                raise Stale
        if not self.lean and not self.plain:
            return True
        grads = list(map(_GRAD, self.lean))
        if self.sharded:
            grads = [g if g is None else local_of(g) for g in grads]
        plain_grads: list[Tensor] = []
        if self.plain:
            plain_grads = list(map(_GRAD, self.plain))
            if self.sharded:
                plain_grads = [g if g is None else local_of(g) for g in plain_grads]
            if None in plain_grads:
                raise Stale
        try:
            pointers = list(map(Tensor.data_ptr, grads))
        except TypeError:  # None: this parameter has no gradient this step
            raise Stale from None
        dtypes = list(map(_DTYPE, grads))
        if dtypes != self.dtypes:
            if any(d not in _GRAD_DTYPES for d in dtypes):
                return False
            if self.kernel == "cpu" and any(
                a is not None and d != _FP32 for a, d in zip(self.fp32_addresses, dtypes)
            ):  # an fp32 parameter updated in place reads an fp32 gradient
                return False
            self.dtypes = dtypes
            if self.kernel == "cpu":
                self.flags[:] = [d == _FP32 for d in dtypes]
        if not all(map(Tensor.is_contiguous, grads)):  # read by address: a contiguous copy for this step
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
            pointers = list(map(Tensor.data_ptr, grads))
        adam = self.entry.counts_steps
        if adam and self.foreach_steps:  # step counts no kernel advances (fp32 parameters on a GPU, odd counts)
            torch._foreach_add_(self.foreach_steps, 1)
        if self.kernel == "cpu":
            self._run_cpu(group, pointers, factor, clamp, found, threads)
        else:
            self._run_cuda(group, pointers, factor, clamp, found)
        if self.plain:
            self._plain(group, plain_grads, factor, clamp, found)
        if adam and found is not None:
            if self.counts is not None and self.plain:  # the fp32 parameters' kernel read the advanced counts
                self.library.lean_settle(self.counts, len(self.steps), found.data_ptr())
            if self.foreach_steps:
                torch._foreach_sub_(self.foreach_steps, [found] * len(self.foreach_steps))
        self.first_step = False
        return True

    def _run_cpu(
        self, group: dict[str, Any], pointers: list[int], factor: Any, clamp: Any, found: Any, threads: int
    ) -> None:
        # what the options are made of, compared: made again on a change (an LR scheduler's)
        values = (
            tuple(map(group.get, self.entry.option_keys)),
            self.first_step,
            factor is not None and factor.data_ptr(),
            clamp,
        )
        if values != self._options[0]:
            self._options = (values, kernel_options(self.entry, group, self.first_step, factor, clamp))
        counts = self.counts
        self.library.lean_step(
            self.pieces, self.count, (ctypes.c_void_p * self.count)(*pointers), self.flags,
            ctypes.byref(self._options[1]), found.data_ptr() if found is not None else None,
            counts, len(self.steps) if counts is not None else 0, int(not self.plain),
            threads, native.GRAIN, self.first_unit,
        )  # fmt: skip

    def _run_cuda(self, group: dict[str, Any], pointers: list[int], factor: Any, clamp: Any, found: Any) -> None:
        if not self.count:
            return
        if pointers != self.pointers:  # a new list: the update's cache compares it with the last one it sent
            table = list(self.table)
            table[2::8] = pointers
            self.table, self.pointers = table, pointers
        assert self.entry.kernel is not None  # a plan with a kernel: its entry has the kernel's options
        options = dict(self.entry.kernel(group, self.first_step), clamped=clamp is not None)
        options["clamp"] = clamp if clamp is not None else -1.0
        update = native.cuda_update(self.owner)
        for fp32 in (False, True):
            chosen = [k for k, d in enumerate(self.dtypes) if (d == _FP32) == fp32]
            if not chosen:
                continue
            if len(chosen) == self.count:
                table, numels, steps = self.table, self.numels, self.lean_steps
            else:  # gradients of both dtypes (rare): one launch per dtype, its rows picked this step
                table = [v for k in chosen for v in self.table[8 * k : 8 * k + 8]]
                numels = tuple(self.numels[k] for k in chosen)
                steps = [self.lean_steps[k] for k in chosen] if self.lean_steps is not None else None
            these = {**options, "grad_fp32": fp32}
            update.launch(
                self.key * 2 + fp32, table, numels, steps, self.on_device, these, found, factor, self.device, True
            )

    def _plain(
        self, group: dict[str, Any], grads: list[Tensor], factor: Optional[Tensor], clamp: Optional[float], found: Any
    ) -> None:
        """fp32 parameters (kept in fp32 by the policy) the kernel does not update (sharded, or on a GPU): their
        gradients clipped in place (:func:`~lightning_mp.master.lean.chunked.apply_grad_ops_in_place`, as torch's
        clipping does on fp32 masters), then torch's fused kernel on them, in place."""
        params = [local_of(p) for p in self.plain] if self.sharded else self.plain_locals
        with torch.no_grad():  # the parameters themselves, updated in place
            ops = ([("mul", factor)] if factor is not None else []) + ([("clamp", clamp)] if clamp is not None else [])
            apply_grad_ops_in_place(self.plain, ops)
            self._fused(group, params, grads, found)

    def _fused(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], found: Any) -> None:
        """torch's fused function of the entry on the fp32 parameters (their step counts advanced around it)."""
        scalars = [self.plain_steps] if self.entry.counts_steps else []
        self.entry.run(group, params, grads, self.plain_states, scalars, float(group["lr"]), found, self.first_step)

    # ------------------------------------------------------------------ inside backward: the fast form
    def make_fast(self, param: Tensor, options: native.Options, found: Optional[Tensor]) -> None:
        """After the plan of ``param`` alone ran inside backward: its fast form, one C call that checks the gradient
        for inf/NaN into ``found`` (the parameter's flag slot; ``None``: no check) and runs the step (skipped where the
        slot is 1), the step count settled after it: the same kernel on the same addresses with ``options`` (its
        group's, rewritten in place by the caller when the group's options change), so the same bits as
        :meth:`run`. Only for one parameter on the CPU kernel, lean or fp32, whose gradient the call can read; else
        none (:meth:`run` each time)."""
        self.fast = None
        grad = param.grad
        if (
            self.kernel != "cpu"
            or grad is None
            or self.sharded
            or self.first_step
            or self.idle
            or self.plain
            or self.foreach_steps
            or self.count != 1
            or self.dtypes != [grad.dtype]
            or self.pieces[0].n != grad.numel()
            or not grad.is_cpu
            or (found is not None and (found.device.type != "cpu" or found.dtype != _FP32))
        ):
            return
        call = native.prepare_call(
            self.pieces, self.flags, options, found, self.counts, len(self.steps), self.first_unit, grad.numel(),
            grad.dtype if found is not None else None,
        )  # fmt: skip
        if call is not None:  # held with it: what its addresses point into
            self.fast = (call, grad.dtype, self.fp32_addresses[0], (found, options))

    def run_fast(self, param: Tensor) -> bool:
        """``param``'s check and update by the fast form; ``False`` (nothing done) where there is none or the
        gradient (or, kept in fp32, the parameter's storage) is not what it was made for."""
        fast = self.fast
        if fast is None:
            return False
        call, dtype, address, _ = fast
        grad = param.grad
        if grad is None or grad.dtype is not dtype or not grad.is_cpu or not grad.is_contiguous():
            return False
        if address is not None and param.data_ptr() != address:  # kept in fp32: its storage swapped (.data = ...)
            return False
        call.grad = grad.data_ptr()
        self.library.lean_step_call(call)
        return True


# ---------------------------------------------------------------------- the one-pass update by the plans
def kernel_options(
    entry: Entry, group: dict[str, Any], first_step: bool, factor: Optional[Tensor], clamp: Optional[float]
) -> native.Options:
    """The CPU kernel's :class:`~lightning_mp.kernels.native.Options` for ``group``: the entry's options
    (:attr:`~lightning_mp.master.lean.optimizers.Entry.kernel`), the clipping factor's address and the clamp."""
    assert entry.kernel is not None  # an entry with the kernel's options
    options = native.Options(**entry.kernel(group, first_step), vec_size=native.vec_size())
    options.grad_mul = factor.data_ptr() if factor is not None else None
    options.clamped, options.clamp = (1, clamp) if clamp is not None else (0, -1.0)
    return options


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
    group: dict[str, Any],
    plans: dict[int, Any],
    store: LeanStore,
    grad_ops: list[tuple[str, Any]],
    generation: int,
    param: Any = None,
) -> Any:
    """The plan among ``plans`` (the store's) that :func:`run` will replay for ``group`` (or, with ``param``, that
    parameter's), when it exists, still fits (:meth:`StepPlan.fits`: ``generation`` is the optimizer's now), no
    parameter of it gained a gradient and the kernel takes the clipping; else ``None``: that step lays out a plan (or
    takes the chunked path) and may refuse state it meets, so a caller checks every state first
    (:func:`~lightning_mp.master.lean.optimizers.check_states`) to refuse before any update. Pass what it returns to
    :func:`run` as ``ready``: the plan is not checked twice."""
    made = plans.get(id(group) if param is None else id(param))
    if (
        made is None  # (kept by the id of its group or parameter, which it holds: the id names no other object)
        or made.kernel is None
        or not made.fits(generation, store)
        or (made.idle and any(p.grad is not None for p in made.idle))
        or (grad_ops and not expressible(grad_ops))
    ):
        return None
    return made


def clipping_for(
    params: list[Tensor], grad_ops: list[tuple[str, Any]]
) -> Optional[tuple[Optional[Tensor], Optional[float]]]:
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
    plans: dict[int, Any],
    store: LeanStore,
    grad_ops: list[tuple[str, Any]],
    found: Optional[Tensor],
    generation: int,
    param: Optional[Tensor] = None,
    ready: Any = None,
    threads: int = 0,
) -> bool:
    """One step of ``group`` (or, with ``param``, of that one parameter of it: the step inside backward) on the lean
    state, in one pass, by its :class:`StepPlan` (made on the first step and whenever it no longer fits:
    ``generation`` is the optimizer's now, :func:`~lightning_mp.master.following.seen`); fp32 parameters (no
    remainder) are updated in place by the same kernel on the CPU, by torch's own fused kernel elsewhere. ``found``: a
    0-dim fp32 tensor on the parameters' device, or ``None``. ``threads``: the CPU kernel's (0: torch's). ``False``
    (nothing done): the chunked path must take it (no kernel for these parameters, clipping the kernel does not
    express, gradients neither bf16 nor fp32)."""
    key, params, owner = (id(group), group["params"], group) if param is None else (id(param), [param], param)
    made = ready
    if made is None:
        made = plans.get(key)
        if made is None or not made.fits(generation, store):
            made = _replan(plans, optimizer, entry, group, params, store, key, owner, generation)
    if made.kernel is None:
        return False
    clipping = plan_grad_ops(grad_ops, made.device) if grad_ops else (None, None)
    if clipping is None:
        return False
    threads = threads or torch.get_num_threads()
    try:
        return made.run(group, clipping[0], clipping[1], found, threads)
    except Stale:  # a gradient appeared or went away since the plan was made
        made = _replan(plans, optimizer, entry, group, params, store, key, owner, generation)
        return made.run(group, clipping[0], clipping[1], found, threads)


def _replan(
    plans: dict[int, Any],
    optimizer: Optimizer,
    entry: Entry,
    group: dict[str, Any],
    params: list[Tensor],
    store: LeanStore,
    key: int,
    owner: Any,
    generation: int,
) -> StepPlan:
    """A new plan under ``key``; plans that describe nothing any more are released with their tensors: those of a
    dead optimizer, and those of ``optimizer`` laid out at another generation (its state was replaced, a group
    removed, ...)."""
    plans.pop(key, None)
    for old in [k for k, p in plans.items() if p.optimizer() in (None, optimizer) and p.generation != generation]:
        del plans[old]
    # the plan of ``params``: with the compiled kernel of their device where :func:`clipping_for` finds one
    made = plans[key] = StepPlan(
        optimizer, entry, group, list(params), store, _kernel_for(params), key, owner, generation
    )
    return made


def restamp(plans: dict[int, Any], optimizer: Optimizer, before: int, after: int) -> None:
    """``optimizer``'s plans laid out or replayed at generation ``before`` hold at ``after`` too: between the two the
    update itself made the state its plans read (a first step), nothing else ran."""
    for made in plans.values():
        if made.generation == before and made.optimizer() is optimizer:
            made.generation = after


def _kernel_for(params: list[Tensor]) -> Optional[str]:
    """``"cpu"`` (the C kernel), ``"cuda"`` (the Triton kernel) or ``None`` (the chunked path) for ``params``."""
    if clipping_for(params, []) is None:
        return None
    return "cpu" if local_of(params[0]).device.type == "cpu" else "cuda"
