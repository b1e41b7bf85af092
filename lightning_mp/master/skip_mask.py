"""The generic lean step's masked skip and group options, as plain functions on tensors (no optimizer, no store).

:class:`~lightning_mp.master.generic.GenericChunkedStep` skips a step on the device by copying a chunk's optimizer
state (the plain inner tensors of tensor subclasses: :func:`leaves`) before the optimizer's ``step()`` and writing
``where(skip, old, new)`` back after it (:func:`mask`); group options that are tensors are masked the same way once
per step (:func:`mask_options`), the others saved and put back between chunks (:func:`snapshot`, :func:`put_back`).
"""

from __future__ import annotations

import copy
from typing import Any

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
