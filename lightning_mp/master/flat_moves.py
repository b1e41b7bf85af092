"""The two per-step moves of flat fp32 masters (:class:`~lightning_mp.master.MasterWeights`), each one foreach op
per device whatever the number of parameters.

The lists they run over are made once: the half parameters, their masters and the masters' gradient views at
setup (in one order), and for the write-back, per optimizer, ``.data`` aliases of the half parameters with the
masters they take. ``.data`` aliases share the parameters' storage but not their version counters, so the
write-back is not a write that :mod:`~lightning_mp.master.model_sync` follows. An alias points at the storage its
parameter had when it was made: the caller passes a key that changes when a parameter's storage may have changed
(``p.data = t`` followed, a load that gave new storage), and the write-back lists are made again then.
"""

from __future__ import annotations

import operator
from collections import defaultdict, deque
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

_grad_of = operator.attrgetter("grad")


class FlatMoves:
    """Per device, the lists the gradient move and the write-back run over (see the module doc)."""

    def __init__(self) -> None:
        # per device: (half model params, their masters, the masters' grad views), in one order
        self.groups: dict[torch.device, tuple[list[nn.Parameter], list[nn.Parameter], list[Tensor]]] = {}
        # id(optimizer) -> (storage key, [(model .data aliases, master values)] per device)
        self._write_backs: dict[int, tuple[Any, list[tuple[list[Tensor], list[Tensor]]]]] = {}

    def add(self, param: nn.Parameter, master: nn.Parameter, grad_view: Tensor) -> None:
        """A half parameter, its master and the master's slice of the flat gradient buffer (at setup)."""
        params, masters, grad_views = self.groups.setdefault(param.device, ([], [], []))
        params.append(param)
        masters.append(master)
        grad_views.append(grad_view)

    def forget_write_backs(self) -> None:
        """The optimizers' groups changed: the write-back lists are made again at their next use."""
        self._write_backs.clear()

    def grads_to_masters(self) -> None:
        """Move the half gradients into the masters' fp32 ``.grad`` and free them: one ``_foreach_copy_`` per device
        when every gradient is new since the last step (the usual case), a ``_foreach_add_`` where masters hold
        gradients already (accumulation, in fp32)."""
        for params, masters, grad_views in self.groups.values():
            halves = list(map(_grad_of, params))
            if halves.count(None) == len(halves):
                continue
            current = list(map(_grad_of, masters))
            if None not in halves and current.count(None) == len(current):
                torch._foreach_copy_(grad_views, halves)  # fp32 copies of the half gradients, exact
                _set_each(masters, "grad", grad_views)
            else:
                _merge_grads(masters, grad_views, halves, current)
            _set_each(params, "grad", repeat(None))

    def masters_to_model(self, optimizer: Optimizer, param_of_master: dict[int, nn.Parameter], key: Any) -> None:
        """Copy the masters ``optimizer`` holds into their half parameters (``param_of_master``: ``id(master) ->
        half parameter``), one ``_foreach_copy_`` per device. ``key``: equal to the last call's while no parameter's
        storage changed; the lists are made again when it differs."""
        made = self._write_backs.get(id(optimizer))
        if made is None or made[0] != key:
            made = self._write_backs[id(optimizer)] = (key, _write_back_lists(optimizer, param_of_master))
        for model_values, masters in made[1]:
            torch._foreach_copy_(model_values, masters)


def _write_back_lists(
    optimizer: Optimizer, param_of_master: dict[int, nn.Parameter]
) -> list[tuple[list[Tensor], list[Tensor]]]:
    by_device: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = defaultdict(lambda: ([], []))
    for group in optimizer.param_groups:
        for master in group["params"]:
            param = param_of_master.get(id(master))
            if param is not None:
                model_values, masters = by_device[param.device]
                model_values.append(param.data)  # an alias with its own version counter, on the same storage
                masters.append(master.detach())
    return list(by_device.values())


def _set_each(tensors: Iterable[Tensor], name: str, values: Iterable[Any]) -> None:
    """``setattr(tensor, name, value)`` pairwise, looped in C (no Python frame per tensor)."""
    deque(map(setattr, tensors, repeat(name), values), maxlen=0)


def _merge_grads(masters: list[nn.Parameter], views: list[Tensor], halves: list[Any], current: list[Any]) -> None:
    """The half gradients ``halves`` (``None``: none) into the masters whose gradients are ``current``: copied into
    the flat views where a master has none, added where it has one (accumulation in fp32)."""
    copy_to, copy_from, fresh, add_to, add_from = [], [], [], [], []
    for master, view, half, grad in zip(masters, views, halves, current):
        if half is None:
            continue
        if grad is None:
            copy_to.append(view)
            copy_from.append(half)
            fresh.append(master)
        else:
            add_to.append(grad)
            add_from.append(half)
    if copy_to:
        torch._foreach_copy_(copy_to, copy_from)
        _set_each(fresh, "grad", copy_to)
    if add_to:
        torch._foreach_add_(add_to, add_from)
