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

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.kernels import native
from lightning_mp.master.lean import chunked, plan
from lightning_mp.master.lean.chunked import Piece, Staging, apply_grad_ops_in_place, plan_chunks
from lightning_mp.master.lean.optimizers import Entry, check_states, entry_for


def _has_grad(param: Tensor) -> bool:
    return param.grad is not None


def _no_layout(group: dict[str, Any]) -> None:
    return None


class LeanUpdate:
    """The update of one optimizer's parameters on ``store``'s lean state; its path chosen at construction: by the
    table entry ``entry`` (one-pass where a plan has a kernel, else chunked) or, ``entry`` ``None``, by ``generic``
    (the optimizer's own ``step()`` on fp32 slices)."""

    def __init__(
        self, optimizer: Optimizer, store: Any, staging: Staging, entry: Optional[Entry], generic: Any
    ) -> None:
        self.optimizer = optimizer
        self.store = store
        self.staging = staging
        self.entry = entry
        self.generic = generic  # None for an optimizer of the table
        #: the group options that change which state exists (the entry's; none on the generic path)
        self.layout: Callable[[dict[str, Any]], Any] = entry.layout if entry is not None else _no_layout
        # the chunked path's pieces by (group index, 0), or inside backward (id(param), 1)
        self.chunks: dict[tuple[int, int], tuple[tuple[int, ...], list[list[Piece]]]] = {}

    # ------------------------------------------------------------------ the normal step
    def run(self, found_inf: Optional[Tensor], grad_ops: list[tuple[str, Any]]) -> None:
        """One step of every group: ``found_inf`` a flag on the device (nonzero: nothing changes) or ``None``."""
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
        # the plans each group replays, where they fit; where one does not (a first step, an edit since the last one)
        # or a group takes the chunked path, every group's state is checked first: a refusal comes before any update
        ready = (
            [plan.ready(optimizer, group, plans, store, grad_ops) for group in groups]
            if entry.kernel is not None and native.enabled()
            else []
        )
        if not ready or None in ready:
            check_states(optimizer, groups, _has_grad)
        for index, group in enumerate(groups):
            if grad_ops:
                apply_grad_ops_in_place([p for p in group["params"] if store.offset_of(p) is None], grad_ops)
            if entry.kernel is not None:
                made = ready[index] if ready else None
                if plan.run(optimizer, entry, group, plans, store, grad_ops, found, ready=made):  # the group's plan
                    continue
            pieces = self._pieces(group["params"], (index, 0))
            chunked.update(entry, optimizer, group, pieces, store, self.staging, grad_ops, found)

    # ------------------------------------------------------------------ the step inside backward
    def check(self, stepped: Callable[[Tensor], bool]) -> None:
        """Before a backward whose hooks update parameter by parameter: every state that ``stepped`` parameters
        hold is checked (a refusal before any update); the generic path checks nothing."""
        if self.generic is None:
            check_states(self.optimizer, self.optimizer.param_groups, stepped)

    def begin_params(self) -> None:
        """A new step whose parts are single parameters (the generic path's group options advance once)."""
        if self.generic is not None:
            self.generic.begin_params()

    def follow_groups(self) -> None:
        """The param groups changed: the generic path slices the new ones."""
        if self.generic is not None:
            self.generic.follow_groups()

    def run_param(self, param: Tensor, group: dict[str, Any], found: Optional[Tensor], grad_ops: list[Any]) -> None:
        """The update of ``param`` alone, with ``group`` (its one-parameter group: its group's options)."""
        if self.generic is not None:  # any other optimizer: its own step() on this parameter's fp32 slices
            self.generic.run_params([param], found, grad_ops)
            return
        entry, store = self.entry, self.store
        assert entry is not None
        # the body of run() for one parameter: an fp32 one clipped in place, then one pass
        if grad_ops and store.offset_of(param) is None:
            apply_grad_ops_in_place([param], grad_ops)
        if entry.kernel is not None and plan.run(
            self.optimizer, entry, group, store.step_plans, store, grad_ops, found, param
        ):
            return
        pieces = self._pieces([param], (id(param), 1))
        chunked.update(entry, self.optimizer, group, pieces, store, self.staging, grad_ops, found)

    # ------------------------------------------------------------------ the chunked path's pieces
    def _pieces(self, params: list[Tensor], key: tuple[int, int]) -> list[list[Piece]]:
        """The chunks of ``params`` (a group's or one parameter), planned once and again when the list changed."""
        ids = tuple(id(p) for p in params)
        cached = self.chunks.get(key)
        if cached is None or cached[0] != ids:
            offsets = {id(p): self.store.offset_of(p) for p in params}
            device = params[0].device if params else torch.device("cpu")
            cached = self.chunks[key] = (ids, plan_chunks(list(params), offsets, self.store.chunk_size_for(device)))
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

    def __init__(self, store: Any) -> None:
        self.store = store
        self.staging = Staging(store.chunk_size_for)
        self.by_optimizer: dict[int, LeanUpdate] = {}

    def of(self, optimizer: Optimizer) -> LeanUpdate:
        """``optimizer``'s update, made the first time (its path chosen then: the table's entry, or the generic
        path for a class the table does not know). Made again on the generic path when the optimizer left the table
        since (a group set ``capturable``)."""
        made = self.by_optimizer.get(id(optimizer))
        if made is not None and (made.generic is not None or entry_for(optimizer) is made.entry):
            return made
        entry = entry_for(optimizer)
        generic = None
        if entry is None:
            generic = self.store.generic_step(optimizer, self.store, self._chunk_of(optimizer))
        made = self.by_optimizer[id(optimizer)] = LeanUpdate(optimizer, self.store, self.staging, entry, generic)
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
