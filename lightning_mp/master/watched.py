"""Whether an optimizer's ``param_groups`` changed since they were last followed, in C-level passes per group.

What a step caches about the groups (fp32 masters swapped into them, the hooks and one-parameter groups of the step
inside backward, the generic path's slices) must be made again whenever a group's parameters change, by any route:
``add_param_group``, a group removed or the groups reordered, ``group["params"] = new_list``, and edits of the list in
place (``append``, ``extend``, ``del``, item assignment, ``reverse``, a permutation, a parameter moved between two
groups: lengths can stay the same). :class:`GroupsSeen` keeps, per group, the group dict and a copy of its parameters
as they were followed, and compares them with the groups as they are: the group dicts by identity, each group's
parameters element by element by identity (``map(operator.is_, ...)``: no Python loop per parameter). The user's
lists are left as they are: a reference to a group's list taken anywhere stays the group's list.
"""

from __future__ import annotations

from operator import is_
from typing import Any

from torch import Tensor
from torch.optim import Optimizer


class GroupsSeen:
    """The param groups of some optimizers as last followed; :meth:`changed` tells whether any changed since.

    :meth:`record` keeps, per optimizer, its ``param_groups`` list and per group ``(group dict, its parameters)``:
    references, not ids, so a freed object's id taken by a new one cannot pass for it."""

    def __init__(self) -> None:
        self._seen: list[tuple[Optimizer, list[dict[str, Any]], list[tuple[dict[str, Any], list[Tensor]]]]] = []

    def record(self, optimizers: list[Optimizer]) -> None:
        """Remember ``optimizers``' groups as they are now."""
        self._seen = [
            (optimizer, optimizer.param_groups, [(group, list(group["params"])) for group in optimizer.param_groups])
            for optimizer in optimizers
        ]

    def changed(self) -> bool:
        """Whether a group was added, removed, replaced or reordered, or its parameters replaced or edited in place,
        since :meth:`record`."""
        for optimizer, groups, seen in self._seen:
            now = optimizer.param_groups
            if now is not groups or len(now) != len(seen):
                return True
            for group, (known, params) in zip(now, seen):
                current = group["params"]
                if group is not known or len(current) != len(params) or not all(map(is_, current, params)):
                    return True
        return False
