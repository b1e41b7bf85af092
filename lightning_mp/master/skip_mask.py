"""The generic lean step's masked skip and group options, as plain functions on tensors (no optimizer, no store).

:class:`~lightning_mp.master.generic.GenericChunkedStep` skips a step on the device by copying a chunk's optimizer
state (the plain inner tensors of tensor subclasses: :func:`leaves`) before the optimizer's ``step()`` and writing
``where(skip, old, new)`` back after it (:func:`mask`); group options that are tensors are masked the same way once
per step (:func:`mask_options`), the others saved and put back between chunks (:func:`snapshot`, :func:`put_back`).
:class:`StepOptions` keeps those options for one optimizer step across its chunks and calls.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Union

import torch
from torch import Tensor


def leaves_of(value: Tensor) -> list[Tensor]:
    """A plain tensor, or the plain inner tensors of a wrapper subclass (``__tensor_flatten__``), recursively."""
    flatten = getattr(value, "__tensor_flatten__", None)
    if type(value) is Tensor or flatten is None:
        return [value]
    return [leaf for name in flatten()[0] for leaf in leaves_of(getattr(value, name))]


def mask(skip: Tensor, before: dict[Any, list[Tensor]], after: dict[Any, list[Tensor]]) -> bool:
    """``after = where(skip, before, after)``, in place (no host synchronisation); ``False`` (nothing masked) when
    the step added or reshaped state."""
    if before.keys() != after.keys() or any(
        [t.shape for t in before[place]] != [t.shape for t in after[place]] for place in before
    ):
        return False
    for place, old_leaves in before.items():
        for old, new in zip(old_leaves, after[place]):
            torch.where(skip, old, new, out=new)
    return True


def mask_options(skip: Tensor, group: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
            torch.where(skip, value, current, out=current)


def same_option(current: Any, saved: Any) -> bool:
    try:
        return bool(current == saved)
    except (RuntimeError, TypeError, ValueError):  # containers of tensors and the like: not comparable here
        return False


def snapshot(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, Tensor) else copy.copy(v)) for k, v in group.items() if k != "params"}


def put_back(group: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
            current.copy_(value)
        else:
            group[key] = copy.copy(value)


class StepOptions:
    """The param groups' options of one optimizer step that runs in several parts (chunks, and calls: the step inside
    backward steps one parameter per call). Saved at the step's first part and put back before every later one, so a
    per-group counter (or a tensor ``lr``) advances once per step; where parts are skipped on the device, the options
    are masked back to the saved ones while no part of the step has stepped."""

    def __init__(self) -> None:
        self.saved: Optional[list[dict[str, Any]]] = None  # the options before the step's first part
        self._none_stepped: Union[bool, Tensor] = True  # no part stepped: True, False, or a device flag

    def begin(self) -> None:
        """A new optimizer step: the next part's options are its start."""
        self.saved = None

    def start_part(self, groups: list[dict[str, Any]]) -> bool:
        """Before a part: whether it is the step's first (then its options are saved, else nothing happens)."""
        if self.saved is not None:
            return False
        self.saved, self._none_stepped = [snapshot(group) for group in groups], True
        return True

    def put_back(self, groups: list[dict[str, Any]]) -> None:
        """The options as they were before the step's first part (before every chunk or call but the first)."""
        assert self.saved is not None
        for group, saved in zip(groups, self.saved):
            put_back(group, saved)

    def part_done(self, groups: list[dict[str, Any]], skip: Optional[Tensor]) -> bool:
        """After a part; ``skip``: its device flag (``None``: it stepped, or was decided on the host). The options stay
        as stepped unless no part of the step stepped: then they are masked back on the device. ``True`` when masked."""
        none = self._none_stepped
        self._none_stepped = False if skip is None or none is False else skip if none is True else none & skip
        if not isinstance(self._none_stepped, Tensor):
            return False
        assert self.saved is not None
        for group, saved in zip(groups, self.saved):
            mask_options(self._none_stepped, group, saved)
        return True
