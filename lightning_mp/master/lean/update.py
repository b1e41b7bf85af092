"""THE dispatch of the lean update: one-pass, chunked or generic, chosen once per optimizer (and group), used by both
the normal step and the step inside backward.

:class:`Updates` is the store's: one :class:`LeanUpdate` per optimizer, made when the store first meets it (at
``attach``, or at its first step), with the staging buffers the chunked and generic paths share. A
:class:`LeanUpdate` holds the optimizer's entry in the table (:mod:`.optimizers`) or, for a class the table does not
know, its generic step (:mod:`.generic`), and per group (or, inside backward, per parameter):

- one-pass: the group's step plan, replayed by :mod:`.plan` where the entry has a kernel and the
  device's kernel is built;
- chunked: torch's own function of the entry on fp32 chunks (:mod:`.chunked`), the pieces planned once;
- generic: the optimizer's own ``step()`` on fp32 slices.

The normal step calls :meth:`LeanUpdate.run` (a whole step of the optimizer); the step inside backward calls
:meth:`LeanUpdate.check` before backward and :meth:`LeanUpdate.run_param` in each parameter's hook.
"""

from __future__ import annotations

import ctypes
from itertools import repeat
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.kernels import native
from lightning_mp.master.following import Generation, seen
from lightning_mp.master.lean import chunked, plan
from lightning_mp.master.lean.chunked import Piece, Staging, apply_grad_ops_in_place, plan_chunks
from lightning_mp.master.lean.eightbit import is_8bit
from lightning_mp.master.lean.interface import LeanStore
from lightning_mp.master.lean.optimizers import Entry, check_states, entry_for


def _has_grad(param: Tensor) -> bool:
    return param.grad is not None


def _requires_grad(param: Tensor) -> bool:
    return param.requires_grad


class LeanUpdate:
    """The update of one optimizer's parameters on ``store``'s lean state; its path chosen at construction: by the
    table entry ``entry`` (one-pass where a plan has a kernel, else chunked) or, ``entry`` ``None``, by ``generic``
    (the optimizer's own ``step()`` on fp32 slices)."""

    def __init__(
        self, optimizer: Optimizer, store: LeanStore, staging: Staging, entry: Optional[Entry], generic: Any
    ) -> None:
        self.optimizer = optimizer
        self.store = store
        self.staging = staging
        self.entry = entry
        self.generic = generic  # None for an optimizer of the table
        #: the optimizer's generation the path was chosen at (following.seen): chosen again when its groups change
        self.chosen_at = -1
        # the chunked path's pieces by (group index, 0), or inside backward (id(param), 1), with the generation
        # (following.seen) they were planned at
        self.chunks: dict[tuple[int, int], tuple[tuple[int, int], list[list[Piece]]]] = {}
        #: inside backward: the state generation checked before this backward (begin_params), every state checked
        #: then; the plans' fast forms are taken only at it
        self.checked: Optional[Generation] = None
        self.fast_at = -1  # the generation the fast forms may run at this backward (-1: none)
        self.fast_layout = -1  # the store's blocks (layout_version) they may run on
        self.fast_options: dict[int, native.Options] = {}  # group index -> the options its fast forms point at
        self.fast_values: dict[int, tuple[Any, ...]] = {}  # group index -> what those options were made of
        self.fast_groups: dict[int, dict[str, Any]] = {}  # group index -> one of its one-parameter groups

    # ------------------------------------------------------------------ the normal step
    def run(self, found_inf: Optional[Tensor], grad_ops: list[tuple[str, Any]], now: Generation) -> None:
        """One step of every group: ``found_inf`` a flag on the device (nonzero: nothing changes) or ``None``;
        ``now`` the optimizer's generation (:func:`~lightning_mp.master.following.seen`, asked with the state)."""
        if self.generic is not None:
            self.generic.run(found_inf, grad_ops)
            return
        found = found_inf
        if found is not None and (found.dtype != torch.float32 or found.dim()):
            found = found.to(torch.float32).reshape(())  # 0-dim, as torch's
        entry, optimizer, store = self.entry, self.optimizer, self.store
        assert entry is not None
        groups = optimizer.param_groups
        plans = store.step_plans
        generation = now.state
        # the plans each group replays, where they fit; where one does not (a first step, an edit since the last one)
        # or a group takes the chunked path, every group's state is checked first: a refusal comes before any update
        ready = (
            list(map(plan.ready, groups, repeat(plans), repeat(store), repeat(grad_ops), repeat(generation)))
            if entry.kernel is not None
            else []
        )
        laid_out = not ready or None in ready
        if laid_out:
            check_states(optimizer, groups, _has_grad)
        for index, group in enumerate(groups):
            if entry.kernel is not None:
                made = ready[index] if ready else None
                if plan.run(optimizer, entry, group, plans, store, grad_ops, found, generation, ready=made):
                    continue
            if grad_ops:  # kept in fp32: clipped in place for torch's kernel (the one-pass kernel clips as it reads)
                apply_grad_ops_in_place([p for p in group["params"] if store.offset_of(p) is None], grad_ops)
            pieces = self._pieces(group, (index, 0), now.groups)
            chunked.update(entry, optimizer, group, pieces, store, self.staging, grad_ops, found)
        if laid_out and ready:  # the state the new plans made is the update's own: they hold at the new generation
            plan.restamp(plans, optimizer, generation, seen(optimizer, state=True).state)

    # ------------------------------------------------------------------ the step inside backward
    def check(self, now: Generation) -> None:
        """Before a backward whose hooks update parameter by parameter (``now``: the optimizer's generation, asked
        with the state): where anything changed since the last backward, every state a trainable parameter holds is
        checked, so a refusal comes before any update; the generic path checks nothing."""
        if self.generic is None and now != self.checked:
            check_states(self.optimizer, self.optimizer.param_groups, _requires_grad)
        self.checked = now

    def begin_params(
        self, ones: dict[int, tuple[int, dict[str, Any]]], grad_ops: list[tuple[str, Any]], agreed: bool
    ) -> None:
        """A new step whose parts are single parameters, after :meth:`check` (``ones``: ``id(param) -> (group index,
        its one-parameter group)``): the generic path's group options advance once; whether this backward's hooks
        take the plans' fast forms (not with clipping other than by value, nor with flags agreed per parameter
        across ranks), each group's options read once into the options those point at."""
        self.fast_at = -1
        if self.generic is not None:
            self.generic.begin_params()
            return
        entry = self.entry
        if (
            entry is None
            or entry.kernel is None
            or agreed
            or self.checked is None
            or [kind for kind, _ in grad_ops] not in ([], ["clamp"])
            or not native.enabled()
            or native.cpu_kernel() is None
        ):
            return
        if not self.fast_groups:
            for index, one in ones.values():
                self.fast_groups.setdefault(index, one)
        clamp = float(grad_ops[0][1]) if grad_ops else None
        for index, one in self.fast_groups.items():
            values = (tuple(map(one.get, entry.option_keys)), clamp)
            if values == self.fast_values.get(index):
                continue
            options = plan.kernel_options(entry, one, False, None, clamp)
            held = self.fast_options.get(index)
            if held is None:
                self.fast_options[index] = options
            else:  # rewritten in place: every fast form of the group points at it
                ctypes.memmove(ctypes.addressof(held), ctypes.addressof(options), ctypes.sizeof(options))
            self.fast_values[index] = values
        self.fast_at, self.fast_layout = self.checked.state, self.store.layout_version

    def end_params(self) -> None:
        """After the updates of one backward (the hooks' ``finish``): what the generic path owes for them (the 8-bit
        step on CUDA: its step counts, :meth:`~.eightbit.Adam8bitStep.end_params`)."""
        if self.generic is not None:
            self.generic.end_params()

    def drop_fast(self) -> None:
        """The fast forms' group options are made again (the groups changed, or the hooks are removed)."""
        self.fast_options, self.fast_values, self.fast_groups = {}, {}, {}
        self.fast_at = -1

    def follow_groups(self) -> None:
        """The param groups changed: the generic path slices the new ones; the fast forms' group options are made
        again."""
        self.drop_fast()
        if self.generic is not None:
            self.generic.follow_groups()

    def run_param(
        self, param: Tensor, index: int, group: dict[str, Any], flags: Any, agree: Any, grad_ops: list[Any]
    ) -> None:
        """The update of ``param`` alone inside backward, with ``group`` (its one-parameter group: its group's
        options; ``index``: its group's), ``flags`` the step's :class:`~lightning_mp.master.in_backward.flags.
        StepFlags` (``None``: no check; ``agree`` sums a flag over the ranks, or ``None``): by its plan's fast form
        where it has one for this backward (the check and the update in one C call), else by its plan (made where
        there is none or it no longer fits), the chunked path, or the generic path."""
        store = self.store
        made = store.step_plans.get(id(param))
        if (
            made is not None
            and made.generation == self.fast_at
            and made.layout_version == self.fast_layout  # (blocks made again: their plans are dropped too)
            and made.run_fast(param)
        ):
            return
        with native.inside_backward():  # its threads: native.backward_threads
            # the 8-bit step checks the gradient in its own kernel call (its slot set there); any other here
            checked = flags is not None and agree is None and self.generic is not None and self.generic.checks_gradients
            found = flags.slot(param) if checked else flags.check(param, agree) if flags is not None else None
            if torch.is_grad_enabled():  # a backward with create_graph=True (autograd runs the others without grad)
                with torch.no_grad():
                    self._run_param(param, group, found, grad_ops, checked)
            else:
                self._run_param(param, group, found, grad_ops, checked)
        if self.fast_at >= 0:  # this backward's hooks take fast forms: this parameter's made from its plan
            made = store.step_plans.get(id(param))
            options = self.fast_options.get(index)
            if made is not None and options is not None:
                made.make_fast(param, options, flags.slot(param) if flags is not None else None)

    def _run_param(
        self, param: Tensor, group: dict[str, Any], found: Optional[Tensor], grad_ops: list[Any], checked: bool
    ) -> None:
        if checked:  # torchao's 8-bit Adam: ``found`` is the parameter's slot, its gradient checked in the step
            self.generic.run_params([param], found, grad_ops, check=True)
            return
        if self.generic is not None:  # any other optimizer: its own step() on this parameter's fp32 slices
            self.generic.run_params([param], found, grad_ops)
            return
        entry, store = self.entry, self.store
        assert entry is not None and self.checked is not None
        if entry.kernel is not None and plan.run(
            self.optimizer, entry, group, store.step_plans, store, grad_ops, found, self.checked.state, param,
            threads=native.backward_threads(),
        ):  # fmt: skip
            return
        if grad_ops and store.offset_of(param) is None:  # kept in fp32: clipped in place for torch's kernel
            apply_grad_ops_in_place([param], grad_ops)
        pieces = self._pieces(group, (id(param), 1), self.checked.groups)
        chunked.update(entry, self.optimizer, group, pieces, store, self.staging, grad_ops, found)

    # ------------------------------------------------------------------ the chunked path's pieces
    def _pieces(self, group: dict[str, Any], key: tuple[int, int], generation: int) -> list[list[Piece]]:
        """The chunks of ``group``'s parameters (a group's, or one parameter's), planned once and again when the
        groups changed (``generation``: the optimizer's groups counter now) or the store's blocks did."""
        version = (generation, self.store.layout_version)
        cached = self.chunks.get(key)
        if cached is None or cached[0] != version:
            params = list(group["params"])
            offsets = {id(p): self.store.offset_of(p) for p in params}
            device = params[0].device if params else torch.device("cpu")
            cached = self.chunks[key] = (version, plan_chunks(params, offsets, self.store.chunk_size_for(device)))
        return cached[1]

    def release(self) -> None:
        """The optimizer leaves the store: the generic path's state goes back to whole parameters."""
        if self.generic is not None:
            self.generic.restore()


class Updates:
    """The store's updates, one :class:`LeanUpdate` per optimizer (by id), and the staging buffers they share.

    Args:
        store: the lean store; ``store.generic_step(optimizer, store, chunk_size)`` makes the generic path's step
            (:class:`~.generic.GenericChunkedStep`, or FSDP2's sharded one).
    """

    def __init__(self, store: LeanStore) -> None:
        self.store = store
        self.staging = Staging(store.chunk_size_for)
        self.by_optimizer: dict[int, LeanUpdate] = {}

    def of(self, optimizer: Optimizer, now: Optional[Generation] = None) -> LeanUpdate:
        """``optimizer``'s update, made the first time (its path chosen then: the table's entry, or the generic
        path for a class the table does not know). Made again on the generic path when the optimizer left the table
        since (a group set ``capturable``): looked at again when its groups changed (``now``: its generation,
        :func:`~lightning_mp.master.following.seen`; ``None``: looked at now)."""
        made = self.by_optimizer.get(id(optimizer))
        if made is not None and (made.generic is not None or (now is not None and made.chosen_at == now.groups)):
            return made
        entry = entry_for(optimizer)
        if made is None or entry is not made.entry:
            generic = None
            if entry is None:  # torchao's 8-bit Adam where the store runs it in one pass, else the generic path
                step = self.store.eight_bit_step if is_8bit(optimizer) else None
                generic = (step or self.store.generic_step)(optimizer, self.store, self._chunk_of(optimizer))
            made = self.by_optimizer[id(optimizer)] = LeanUpdate(optimizer, self.store, self.staging, entry, generic)
        if now is not None:
            made.chosen_at = now.groups
        return made

    def get(self, optimizer: Optimizer) -> Optional[LeanUpdate]:
        """``optimizer``'s update if one was made."""
        return self.by_optimizer.get(id(optimizer))

    def forget(self, optimizer: Optimizer) -> None:
        """``optimizer`` is no longer stepped: its update released."""
        made = self.by_optimizer.pop(id(optimizer), None)
        if made is not None:
            made.release()

    def replan(self) -> None:
        """Forget every chunk plan (the optimizers changed): made again at the next step."""
        for made in self.by_optimizer.values():
            made.chunks.clear()

    def release(self) -> None:
        """At restore: every generic path's state back to whole parameters, the staging buffers freed."""
        for made in self.by_optimizer.values():
            made.release()
        self.staging.release()

    def _chunk_of(self, optimizer: Optimizer) -> int:
        first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        return self.store.chunk_size_for(first.device if first is not None else torch.device("cpu"))
