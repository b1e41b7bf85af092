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
optimizer would read now; otherwise it is rebuilt, never patched. :meth:`StepPlan.fits` re-reads those inputs each
step, by identity and address, in a few C-level passes (``map``), no aten op and no Python loop per parameter:

- the optimizer's ``state`` object (``load_state_dict`` replaces it), the store's blocks (``layout_version``),
  ``amsgrad`` or momentum switched;
- the group's parameters, element by element (``params`` edited in place: ``append``, ``extend``, ``del``, item
  assignment, a new list; ``add_param_group`` makes a new group, and so a new plan);
- each stepped parameter's state dict in ``optimizer.state`` (``state[p] = {}``, a restored copy) and the state
  tensors in it (``state[p]["exp_avg"] = t``, ``clear``, ``pop``, ``update``: a key gone is a rebuild too);
- the address of every tensor whose address the kernel is given (``exp_avg.data = t`` swaps the storage under the
  same tensor object).

Memory safety: the plan holds every tensor and storage whose address it hands the kernel (the block slices, the
state tensors, their storages), so an address it gives is always live memory; and it gives an address only after
checking that it is still where the tensor's data is, so a swapped storage is followed, never written through.
A parameter whose gradient appeared or went away is met while reading the gradients (:class:`Stale`). State that
the kernel cannot read (not fp32, another shape or device, not contiguous) is refused when the plan is laid out, by
name, before any update of the step.
"""

from __future__ import annotations

import ctypes
import weakref
from itertools import chain, repeat
from operator import is_
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.kernels import native
from lightning_mp.master.lean.optimizers import Entry, local_of, state_for

_FP32 = torch.float32
_GRAD_DTYPES = (torch.bfloat16, torch.float32)


class Plans(dict):
    """A store's plans by the id of their group (or parameter). A copy or a pickle of the store starts without any:
    ids and addresses belong to this process's objects (and ctypes arrays of addresses cannot be pickled)."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (Plans, ())


class Stale(Exception):
    """The parameters that have a gradient are no longer the plan's: build a new one."""


_EMPTY: dict[str, Any] = {}


class StateSeen:
    """The optimizer state of some parameters as last read, compared in C-level passes (``map``, no Python loop per
    parameter): the ``state`` object, the parameters, each one's state dict, every value in them (by identity), every
    tensor's address, and each group's options that change the state's layout (the entry's ``layout``: ``amsgrad``,
    SGD's momentum on). It holds those tensors and their storages, so an
    address it recorded cannot be freed memory while it lives.

    A :class:`StepPlan` keeps one over its stepped parameters (what it hands the kernel). The step inside backward,
    which lays out one plan per parameter in its hook, keeps one over all its parameters and asks :meth:`changed`
    before each backward: where anything changed, every state is checked first
    (:func:`~lightning_mp.master.lean.optimizers.check_states`), so a refusal comes before any update of that
    backward."""

    def __init__(self, layout: Callable[[dict[str, Any]], Any]) -> None:
        self.layout = layout
        self.state: Any = None

    def record(self, optimizer: Optimizer, params: list[Tensor]) -> None:
        self.state = optimizer.state
        self.params = list(params)
        self.switches = list(map(self.layout, optimizer.param_groups))
        self.dicts = list(map(optimizer.state.get, self.params, repeat(_EMPTY)))
        self.values = list(chain.from_iterable(map(dict.values, self.dicts)))
        self.tensors = [v for v in self.values if isinstance(v, Tensor)]
        self.sharded = any(local_of(t) is not t for t in self.tensors)  # DTensors: the local shards' addresses
        locals_ = [local_of(t) for t in self.tensors]
        self.addresses = [t.data_ptr() for t in locals_]
        self.storages = [t.untyped_storage() for t in locals_]  # held: no recorded address can be freed

    def changed(self, optimizer: Optimizer, params: list[Tensor]) -> bool:
        state = optimizer.state
        if (
            state is not self.state
            or len(params) != len(self.params)
            or not all(map(is_, params, self.params))
            or list(map(self.layout, optimizer.param_groups)) != self.switches
        ):
            return True
        dicts = list(map(state.get, params, repeat(_EMPTY)))
        if not all(map(is_, dicts, self.dicts)):
            return True
        values = list(chain.from_iterable(map(dict.values, dicts)))
        if len(values) != len(self.values) or not all(map(is_, values, self.values)):
            return True
        tensors = map(local_of, self.tensors) if self.sharded else self.tensors
        return list(map(Tensor.data_ptr, tensors)) != self.addresses


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
        store: Any,
        kernel: Optional[str],
        key: int,
        owner: Any,
    ) -> None:
        self.entry = entry
        self.kernel = kernel
        self.key = key
        self.owner_object = owner
        self.state = optimizer.state
        self.optimizer = weakref.ref(optimizer)
        self.owner = store  # the CUDA update's caches are the store's
        self.layout_version = getattr(store, "layout_version", 0)
        self.layout = entry.layout(group)  # the options that change what state is laid out (amsgrad, momentum)
        self.params = list(params)  # compared element by element with the group's list at every step
        self.device = local_of(params[0]).device if params else torch.device("cpu")
        self.sharded = any(local_of(p) is not p for p in params)  # DTensors: the local shards are read
        self._options: tuple[tuple[Any, ...], Any] = ((), None)
        self.seen: Optional[StateSeen] = None  # the stepped parameters' state as laid out: re-read by fits()
        if kernel is not None:
            self._lay_out(optimizer, group, self.params, store)

    def fits(self, optimizer: Optimizer, group: dict[str, Any], store: Any, params: list[Tensor]) -> bool:
        """Whether everything the plan read is still what torch's optimizer would read now (module doc): identities
        and addresses compared in C-level passes, no Python loop per parameter."""
        state = optimizer.state
        if (
            state is not self.state
            or store.layout_version != self.layout_version
            or self.entry.layout(group) != self.layout
            or len(params) != len(self.params)
            or not all(map(is_, params, self.params))
        ):
            return False
        return self.seen is None or not self.seen.changed(optimizer, self.seen.params)

    def current(self, optimizer: Optimizer, groups: list[dict[str, Any]]) -> bool:
        """Whether the plan may still be used (else it is released with what it holds): its optimizer alive, with the
        same state object, and, for a group's plan of ``optimizer``, the group still in its ``groups``."""
        mine = self.optimizer()
        if mine is None or mine.state is not self.state:
            return False
        return (
            mine is not optimizer
            or not isinstance(self.owner_object, dict)
            or any(g is self.owner_object for g in groups)
        )

    # ------------------------------------------------------------------ built once
    def _lay_out(self, optimizer: Optimizer, group: dict[str, Any], params: list[Tensor], store: Any) -> None:
        stepped = [p for p in params if p.grad is not None]
        self.idle = [p for p in params if p.grad is None]  # a gradient appearing here makes the plan stale
        check = getattr(store, "check_trained", None)
        if check is not None:
            check(stepped)  # a parameter put in the group by hand must be one the store holds
        entry = self.entry
        adam = entry.counts_steps  # step counts advanced around the kernel (Adam's), or none (SGD's)
        keys = entry.keys(group)
        self.first_step = entry.first_step(optimizer, group, stepped)
        states = [state_for(entry, optimizer, p, group) for p in stepped]
        self.seen = StateSeen(entry.layout)
        self.seen.record(optimizer, stepped)  # after the states were made: what the kernel is handed
        lean = [i for i, p in enumerate(stepped) if store.offset_of(p) is not None]
        plain = [i for i, p in enumerate(stepped) if store.offset_of(p) is None]
        self.lean = [stepped[i] for i in lean]
        self.plain = [stepped[i] for i in plain]
        self.plain_locals = [local_of(p) for p in self.plain]
        self.plain_states = [[local_of(states[i][key]) for i in plain] for key in keys]
        self.steps = [s["step"] for s in states] if adam else []
        self.plain_steps = [states[i]["step"] for i in plain] if adam else []
        self.lean_steps = [states[i]["step"] for i in lean] if adam else None
        self.held: list[Tensor] = []  # the block slices and state tensors whose addresses the kernel is given
        rows = []
        for param, i in zip(self.lean, lean):
            local = local_of(param)
            offset = store.offset_of(param)
            high, low = store.flat_slices(local.device, offset, offset + local.numel())
            tensors = [local_of(states[i][key]) for key in keys]
            self.held += [high, low, *tensors]
            addresses = [t.data_ptr() for t in tensors] + [0] * (3 - len(tensors))
            rows.append([high.data_ptr(), low.data_ptr(), 0, *addresses, local.numel()])
        self.count = len(rows)
        self.dtypes: list[torch.dtype] = []
        self.pointers: list[int] = []
        if self.kernel == "cpu":
            steps = self.lean_steps
            self.pieces = (native.Piece * len(rows))(
                *[
                    native.Piece(*(a or None for a in row[:6]), steps[k].data_ptr() if adam else None, row[6], 0)
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
            step_addresses = [s.data_ptr() for s in steps] if self.on_device else [0] * len(rows)
            self.table = [value for row, step in zip(rows, step_addresses) for value in (*row, step)]
            self.numels = tuple(row[6] for row in rows)
            self.counts = None
            self.foreach_steps = self.plain_steps if self.on_device else self.steps  # the rest: the bias kernel's

    # ------------------------------------------------------------------ each step
    def run(self, group: dict[str, Any], factor: Optional[Tensor], clamp: Optional[float], found: Any) -> bool:
        """One update of the planned parameters; ``False`` (nothing done) where a gradient's dtype is neither bf16
        nor fp32 (the chunked path takes it). Raises :class:`Stale` when the plan no longer fits."""
        for param in self.idle:
            if param.grad is not None:
                raise Stale
        if not self.lean and not self.plain:
            return True
        grads = [p.grad for p in self.lean]
        plain_grads = [p.grad for p in self.plain]
        if self.sharded:
            grads = [g if g is None else local_of(g) for g in grads]
            plain_grads = [g if g is None else local_of(g) for g in plain_grads]
        for grad in plain_grads:
            if grad is None:
                raise Stale
        try:
            pointers = [g.data_ptr() for g in grads]
        except AttributeError:  # None: this parameter has no gradient this step
            raise Stale from None
        dtypes = [g.dtype for g in grads]
        if dtypes != self.dtypes:
            if any(d not in _GRAD_DTYPES for d in dtypes):
                return False
            self.dtypes = dtypes
            if self.kernel == "cpu":
                self.flags[:] = [d == _FP32 for d in dtypes]
        if not all(map(Tensor.is_contiguous, grads)):  # read by address: a contiguous copy for this step
            grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
            pointers = [g.data_ptr() for g in grads]
        adam = self.entry.counts_steps
        if adam and self.foreach_steps:  # step counts no kernel advances (fp32 parameters on a GPU, odd counts)
            torch._foreach_add_(self.foreach_steps, 1)
        if self.kernel == "cpu":
            self._run_cpu(group, pointers, factor, clamp, found)
        else:
            self._run_cuda(group, pointers, factor, clamp, found)
        if self.plain:
            self._plain(group, plain_grads, found)
        if adam and found is not None:
            if self.counts is not None and self.plain:  # the fp32 parameters' kernel read the advanced counts
                native.cpu_kernel().lean_settle(self.counts, len(self.steps), found.data_ptr())
            if self.foreach_steps:
                torch._foreach_sub_(self.foreach_steps, [found] * len(self.foreach_steps))
        self.first_step = False
        return True

    def _run_cpu(self, group: dict[str, Any], pointers: list[int], factor: Any, clamp: Any, found: Any) -> None:
        values = kernel_values(self.entry, group, self.first_step, factor, clamp)
        if values != self._options[0]:
            self._options = (values, kernel_options(values))
        library = native.cpu_kernel()
        counts = self.counts
        library.lean_step(
            self.pieces, self.count, (ctypes.c_void_p * self.count)(*pointers), self.flags,
            ctypes.byref(self._options[1]), found.data_ptr() if found is not None else None,
            counts, len(self.steps) if counts is not None else 0, int(not self.plain),
            native.threads(), native.GRAIN, self.first_unit,
        )  # fmt: skip

    def _run_cuda(self, group: dict[str, Any], pointers: list[int], factor: Any, clamp: Any, found: Any) -> None:
        if not self.count:
            return
        if pointers != self.pointers:  # a new list: the update's cache compares it with the last one it sent
            table = list(self.table)
            table[2::8] = pointers
            self.table, self.pointers = table, pointers
        names = ("kind", "amsgrad", "maximize", "nesterov", "first_step", "lr", "beta1", "beta2", "weight_decay",
                 "eps", "momentum", "dampening")  # fmt: skip
        options = dict(zip(names, self.entry.kernel(group, self.first_step)), clamped=clamp is not None)
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

    def _plain(self, group: dict[str, Any], grads: list[Tensor], found: Any) -> None:
        """fp32 parameters (kept in fp32 by the policy): torch's fused kernel on them, in place."""
        params = [local_of(p) for p in self.plain] if self.sharded else self.plain_locals
        with torch.no_grad():  # the parameters themselves, updated in place
            self._fused(group, params, grads, found)

    def _fused(self, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], found: Any) -> None:
        """torch's fused function of the entry on the fp32 parameters (their step counts advanced around it)."""
        scalars = [self.plain_steps] if self.entry.counts_steps else []
        self.entry.run(group, params, grads, self.plain_states, scalars, float(group["lr"]), found, self.first_step)


# ---------------------------------------------------------------------- the one-pass update by the plans
def kernel_values(
    entry: Entry, group: dict[str, Any], first_step: bool, factor: Optional[Tensor], clamp: Optional[float]
) -> tuple[Any, ...]:
    """What the CPU kernel's options are made of (:func:`kernel_options`): the entry's options of ``group``, the
    clipping factor's address and the clamp (compared from step to step: options are made again only on a change)."""
    return (*entry.kernel(group, first_step), factor.data_ptr() if factor is not None else None, clamp)


def kernel_options(values: tuple[Any, ...]) -> native.Options:
    """The CPU kernel's :class:`~lightning_mp.kernels.native.Options` of ``values`` (:func:`kernel_values`)."""
    names = ("kind", "amsgrad", "maximize", "nesterov", "first_step", "lr", "beta1", "beta2", "weight_decay",
             "eps", "momentum", "dampening", "grad_mul")  # fmt: skip
    options = native.Options(**dict(zip(names, values)), vec_size=native.vec_size())
    clamp = values[-1]
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
    optimizer: Optimizer,
    group: dict[str, Any],
    plans: Plans,
    store: Any,
    grad_ops: list[tuple[str, Any]],
    param: Any = None,
) -> Any:
    """The plan among ``plans`` (the store's) that :func:`run` will replay for ``group`` (or, with ``param``, that
    parameter's), when it exists, still fits (:meth:`StepPlan.fits`), no parameter of it gained a gradient and the
    kernel takes the clipping; else ``None``: that step lays out a plan (or takes the chunked path) and may refuse
    state it meets, so a caller checks every state first (:func:`~lightning_mp.master.lean.optimizers.check_states`)
    to refuse before any update. Pass what it returns to :func:`run` as ``ready``: the plan is not checked twice."""
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
    plans: Plans,
    store: Any,
    grad_ops: list[tuple[str, Any]],
    found: Optional[Tensor],
    param: Optional[Tensor] = None,
    ready: Any = None,
) -> bool:
    """One step of ``group`` (or, with ``param``, of that one parameter of it: the step inside backward) on the lean
    state, in one pass, by its :class:`StepPlan` (made on the first step and whenever it
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
    # the plan of ``params``: with the compiled kernel of their device where :func:`clipping_for` finds one
    made = plans[key] = StepPlan(optimizer, entry, group, list(params), store, _kernel_for(params), key, owner)
    return made


def _kernel_for(params: list[Tensor]) -> Optional[str]:
    """``"cpu"`` (the C kernel), ``"cuda"`` (the Triton kernel) or ``None`` (the chunked path) for ``params``."""
    if clipping_for(params, []) is None:
        return None
    return "cpu" if local_of(params[0]).device.type == "cpu" else "cuda"
