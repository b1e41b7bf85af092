"""Whether an optimizer's ``param_groups`` changed since they were last followed, in a few checks per group.

What a step caches about the groups (fp32 masters swapped into them, the hooks and one-parameter groups of the step
inside backward, the generic path's slices) must be made again whenever a group's parameters change, by any route:
``add_param_group``, a group removed or the groups reordered, ``group["params"] = new_list``, and edits of the list in
place (``append``, ``extend``, ``del``, item assignment, ``reverse``, a permutation, a parameter moved between two
groups: lengths can stay the same). Comparing every parameter at every step would cost Python per parameter; instead
each group's ``params`` list is replaced, once, by a :class:`WatchedList` (a ``list`` with the same items, whose every
mutating method counts a version), and :class:`GroupsSeen` compares per group the group dict, its list object and
that version: ``load_state_dict`` (new group dicts), a new list and an edit in place each show.

A reference to a group's list taken before the plugin's setup (``params = optimizer.param_groups[0]["params"]`` in
``configure_optimizers``) is no longer the group's afterwards: edit ``optimizer.param_groups[i]["params"]`` itself.
"""

from __future__ import annotations

from typing import Any, SupportsIndex

from torch.optim import Optimizer


class WatchedList(list):
    """A list that counts its edits in :attr:`version` (every method that changes it bumps it)."""

    version = 0

    def _edited(self) -> None:
        self.version += 1

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._edited()

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._edited()

    def __iadd__(self, values: Any) -> WatchedList:  # type: ignore[override,misc]
        super().__iadd__(values)
        self._edited()
        return self

    def __imul__(self, count: SupportsIndex) -> WatchedList:  # type: ignore[override,misc]
        super().__imul__(count)
        self._edited()
        return self

    def append(self, value: Any) -> None:
        super().append(value)
        self._edited()

    def extend(self, values: Any) -> None:
        super().extend(values)
        self._edited()

    def insert(self, index: SupportsIndex, value: Any) -> None:
        super().insert(index, value)
        self._edited()

    def pop(self, index: SupportsIndex = -1) -> Any:
        value = super().pop(index)
        self._edited()
        return value

    def remove(self, value: Any) -> None:
        super().remove(value)
        self._edited()

    def clear(self) -> None:
        super().clear()
        self._edited()

    def reverse(self) -> None:
        super().reverse()
        self._edited()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        super().sort(*args, **kwargs)
        self._edited()


def watch(group: dict[str, Any]) -> WatchedList:
    """``group["params"]``, made a :class:`WatchedList` (the same items) if it is not one yet."""
    params = group["params"]
    if type(params) is not WatchedList:
        params = group["params"] = WatchedList(params)
    return params


class GroupsSeen:
    """The param groups of some optimizers as last followed; :meth:`changed` tells whether any changed since.

    :meth:`record` watches every group's list (:func:`watch`) and keeps, per optimizer, its ``param_groups`` list
    and per group ``(group dict, params list, its version)``: references, not ids, so a freed object's id taken
    by a new one cannot pass for it."""

    def __init__(self) -> None:
        self._seen: list[tuple[Optimizer, list[dict[str, Any]], list[tuple[dict[str, Any], WatchedList, int]]]] = []

    def record(self, optimizers: list[Optimizer]) -> None:
        """Watch ``optimizers``' groups as they are now."""
        self._seen = [
            (
                optimizer,
                optimizer.param_groups,
                [(group, params, params.version) for group in optimizer.param_groups for params in [watch(group)]],
            )
            for optimizer in optimizers
        ]

    def changed(self) -> bool:
        """Whether a group was added, removed, replaced or reordered, or its ``params`` replaced or edited in place,
        since :meth:`record`: a few identity checks per group."""
        for optimizer, groups, seen in self._seen:
            now = optimizer.param_groups
            if now is not groups or len(now) != len(seen):
                return True
            for group, (known, params, version) in zip(now, seen):
                if group is not known or group["params"] is not params or params.version != version:
                    return True
        return False
