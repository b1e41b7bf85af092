"""Converted buffers: the model's 16-bit buffer and the full-precision value it stands for.

With master weights a model's floating buffers become 16-bit with its parameters (except in modules kept in fp32).
No optimizer steps a buffer, so no master holds one, but training code writes buffers during fit: anomalib fills its
anomaly threshold and score range (registered as NaN) with ``copy_`` at each validation epoch end; running
statistics and EMA buffers are written in hooks; a hook may assign a new tensor. What a checkpoint holds and what the
model holds after fit is, element by element:

- the buffer's value before the cast, where the model's 16-bit buffer still holds that value's rounding (nothing
  wrote it, or a write left it as it was: a broadcast of the same values under DDP);
- what the model holds, upcast, wherever a write changed it (in place, ``buffer.data = t``, or another tensor put in
  the module: a full-precision tensor assigned stays exact);
- what a load brought (Lightning's resume, ``fabric.load``, ``load_state_dict`` into any module), at its precision.

The value is worked out where it is asked for (every checkpoint, teardown), not per step. A value written in place
into a 16-bit buffer is held at 16-bit precision by the model itself (as with ``bf16-true``); keep the module that
owns such a buffer in fp32 (``keep_fp32``) where its full precision matters.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import is_tensor_like


@dataclass
class HalfBuffer:
    """One converted buffer: ``owner._buffers[name]`` was ``half`` (the 16-bit tensor made at the conversion or at the
    last record), standing for the full-precision ``exact``, when its version and storage were as recorded."""

    owner: nn.Module
    name: str
    exact: Tensor
    half: Tensor
    version: int
    pointer: int

    def untouched(self, current: Tensor) -> bool:
        return current is self.half and current._version == self.version and current.data_ptr() == self.pointer

    def record(self, exact: Tensor, current: Tensor) -> None:
        self.exact, self.half, self.version, self.pointer = exact, current, current._version, current.data_ptr()


class ConvertedBuffers:
    """The converted buffers of one model (module doc): made by the conversion, read by every save and at teardown."""

    def __init__(self) -> None:
        self._by_owner: dict[int, list[HalfBuffer]] = {}
        self._loaded: dict[int, Any] = {}  # id(entry) -> the value a load in progress brings

    def convert(self, owner: nn.Module, name: str, dtype: torch.dtype) -> None:
        """Cast ``owner``'s floating buffer ``name`` to ``dtype`` in the module, its value before the cast kept."""
        original = owner._buffers[name]
        assert original is not None
        half = original.to(dtype)
        owner._buffers[name] = half
        self._by_owner.setdefault(id(owner), []).append(
            HalfBuffer(owner, name, original, half, half._version, half.data_ptr())
        )

    def owners(self) -> list[nn.Module]:
        """The modules that own converted buffers."""
        return [entries[0].owner for entries in self._by_owner.values()]

    def __iter__(self) -> Iterator[HalfBuffer]:
        for entries in self._by_owner.values():
            yield from entries

    def of(self, owner: nn.Module) -> list[HalfBuffer]:
        return self._by_owner.get(id(owner), [])

    @torch.no_grad()
    def value(self, entry: HalfBuffer) -> Optional[Tensor]:
        """The buffer's full-precision value now (module doc); ``None`` where the module holds no buffer there."""
        current = entry.owner._buffers.get(entry.name)
        if current is None:
            return None
        if entry.untouched(current):
            return entry.exact.to(current.device)
        if not current.is_floating_point() or current.dtype.itemsize >= entry.exact.dtype.itemsize:
            return current  # not 16-bit: the module holds the value at its own precision
        wide = current.to(entry.exact.dtype)
        if current is entry.half and current.data_ptr() == entry.pointer and current.shape == entry.exact.shape:
            # written in place: the elements whose 16-bit value is still the rounding of the exact one keep it
            exact = entry.exact.to(current.device)
            wide = torch.where(current == exact.to(current.dtype), exact, wide)
        entry.record(wide, current)  # the next question starts from this answer
        return wide

    def restore(self) -> None:
        """Give the model back its buffers at full precision (teardown)."""
        for entry in self:
            value = self.value(entry)
            if value is not None:
                entry.owner._buffers[entry.name] = value
        self._by_owner = {}

    # ------------------------------------------------------------------ loads (the model sync's hooks call these)
    def before_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        """Keep the values a load brings for ``module``'s converted buffers, before torch rounds them into the model."""
        for entry in self.of(module):
            value = state_dict.get(prefix + entry.name)
            if value is not None and is_tensor_like(value):
                self._loaded[id(entry)] = value

    @torch.no_grad()
    def after_load(self, module: nn.Module) -> None:
        """torch has copied the loaded values into ``module``'s buffers: they are the buffers' exact values now."""
        for entry in self.of(module):
            value = self._loaded.pop(id(entry), None)
            current = module._buffers.get(entry.name)
            if value is None or current is None:
                continue
            if current is not entry.half:  # load_state_dict(assign=True): the module holds the loaded tensor
                entry.record(current, current)
                continue
            exact = torch.empty(tuple(value.shape), dtype=entry.exact.dtype, device=current.device).copy_(value)
            entry.record(exact, current)
