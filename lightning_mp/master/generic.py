"""Any ``torch.optim.Optimizer`` on lean master weights: its own ``step()`` on fp32 slices, chunk by chunk.

The optimizer keeps its own per-parameter state (torchao's 8-bit or 4-bit states, torch-optimi's Kahan buffers,
anything), keyed by *proxy* parameters: one fp32 ``nn.Parameter`` per slice of a model parameter. A slice is a
block of whole rows (along dim 0) of at most ``chunk_size`` elements, a multiple of 256 elements where the rows
allow it (block-quantised states: see ``QUANTUM``); a parameter that fits in a chunk is one slice with its own
shape. Between steps a proxy holds no storage (a zero-stride fp32 placeholder of its shape), so the
state is as small as the optimizer makes it and no fp32 copy of the model exists.

A step, per chunk of slices of one param group: join the slices' bf16 weights and remainders into an fp32 staging
buffer and point the proxies at it (``proxy.data``), give them fp32 gradients (upcast, clipping applied), put only
these proxies in their group's ``params`` (the other groups empty) and call the optimizer's ``step()``; then split
the staging values back into weights and remainders. The group's options (``lr``, and any counter the optimizer
keeps in the group) are put back as they were before each chunk but the first, so a per-group counter advances
once per step. Parameters kept in fp32 are sliced the same way, their proxies pointing at the parameter itself.

Exactness: for an optimizer that treats elements independently (Adam family, SGD, Lion, torch-optimi, torchao's
block-quantised states, whose blocks the 256-aligned slices keep where they are in the whole parameter), the result
is the optimizer's own update of fp32 parameters holding the exact values. Optimizers that look at a parameter's
shape (Adafactor, Shampoo, Muon) see row blocks of parameters larger than ``chunk_size``; raise ``chunk_size`` above
the largest parameter to give them whole parameters (the transient memory then grows to that parameter's size).

Transient memory: fp32 staging values and gradients of one chunk (8 bytes x ``chunk_size``) plus the optimizer's
own temporaries for that chunk. ``found_inf``: the generic path reads it on the host (one synchronisation per step)
and skips the whole step when it is nonzero; only the fused AdamW/Adam/SGD path skips on the device.

``optimizer.state_dict()`` and ``load_state_dict()`` see the proxies (hooks swap them into ``param_groups`` for the
call), so a checkpoint holds the per-slice state and resumes exactly into the same model and ``chunk_size``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.master.step import apply_grad_ops, apply_grad_ops_in_place


class _Slice:
    """Rows ``[row_start, row_end)`` of ``param`` (elements ``[start, end)`` of its flattening) and its proxy."""

    def __init__(self, param: Tensor, start: int, end: int, shape: tuple[int, ...]) -> None:
        self.param, self.start, self.end, self.shape = param, start, end, shape
        self.proxy = nn.Parameter(_placeholder(shape, param.device), requires_grad=param.requires_grad)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def rest(self) -> None:
        self.proxy.data = _placeholder(self.shape, self.param.device)
        self.proxy.grad = None


def _placeholder(shape: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=device).expand(shape)


#: Slices hold a multiple of this many elements where a chunk allows it (row blocks of ``QUANTUM / gcd(row,
#: QUANTUM)`` rows): block-quantised optimizer states (torchao's 8-bit: blocks of 256, 4-bit: 128) quantise a tensor
#: whose size is a multiple of their block and fall back to fp32 state otherwise; aligned slices also keep the blocks
#: where they are in the whole parameter, so the quantisation is the same.
QUANTUM = 256


def _slices_of(param: Tensor, chunk_size: int) -> list[_Slice]:
    numel = param.numel()
    if numel <= chunk_size or param.dim() < 1:
        return [_Slice(param, 0, numel, tuple(param.shape))]
    row = numel // param.shape[0]
    rows_per_slice = max(1, chunk_size // row)
    aligned = QUANTUM // math.gcd(row, QUANTUM)  # rows per multiple of QUANTUM elements
    if aligned <= rows_per_slice:
        rows_per_slice -= rows_per_slice % aligned
    slices = []
    for first in range(0, param.shape[0], rows_per_slice):
        last = min(first + rows_per_slice, param.shape[0])
        slices.append(_Slice(param, first * row, last * row, (last - first, *param.shape[1:])))
    return slices


class GenericChunkedStep:
    """Runs ``optimizer.step()`` on fp32 proxy slices of the lean parameters, one chunk at a time (see module doc).

    Args:
        optimizer: the user's optimizer; its ``param_groups`` keep the model's parameters between steps.
        store: the :class:`~lightning_mp.master.remainder.RemainderMasters` holding the weights and remainders.
        chunk_size: at most this many elements are fp32 at once (a bigger single row is one slice on its own).
    """

    def __init__(self, optimizer: Optimizer, store: Any, chunk_size: int) -> None:
        self.optimizer = optimizer
        self.store = store
        self.chunk_size = chunk_size
        self.slices: list[list[_Slice]] = [
            [s for p in group["params"] for s in _slices_of(p, chunk_size)] for group in optimizer.param_groups
        ]
        self._model_params: list[list[Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        self._hooks = [
            optimizer.register_state_dict_pre_hook(lambda opt: self._swap_in_proxies()),
            optimizer.register_state_dict_post_hook(lambda opt, state: self._swap_out_proxies()),
            optimizer.register_load_state_dict_pre_hook(lambda opt, state: self._swap_in_proxies()),
            optimizer.register_load_state_dict_post_hook(lambda opt: self._swap_out_proxies()),
        ]

    def _swap_in_proxies(self) -> None:
        for group, slices in zip(self.optimizer.param_groups, self.slices):
            group["params"] = [s.proxy for s in slices]

    def _swap_out_proxies(self) -> None:
        for group, params in zip(self.optimizer.param_groups, self._model_params):
            group["params"] = list(params)

    def step(self, found_inf: Optional[Tensor], grad_ops: list[tuple[str, Any]]) -> None:
        """One step of the optimizer over every chunk (skipped entirely when ``found_inf`` is nonzero)."""
        if found_inf is not None and bool(found_inf.item()):  # a host synchronisation (see module doc)
            return
        groups = self.optimizer.param_groups
        apply_grad_ops_in_place(
            [p for params in self._model_params for p in params if self.store.offset_of(p) is None], grad_ops
        )
        chunks = [(index, chunk) for index, slices in enumerate(self.slices) for chunk in self._chunks(slices)]
        options = [_snapshot(group) for group in groups]
        try:
            for number, (index, chunk) in enumerate(chunks):
                if number:
                    for group, saved in zip(groups, options):
                        _put_back(group, saved)
                staged = self._stage(chunk)
                if staged is not None:
                    apply_grad_ops(staged, grad_ops)
                for position, group in enumerate(groups):
                    group["params"] = [s.proxy for s in chunk] if position == index else []
                self.optimizer.step()
                self._unstage(chunk)
        finally:
            for slices in self.slices:
                for s in slices:
                    s.rest()
            self._swap_out_proxies()

    def _chunks(self, slices: list[_Slice]) -> list[list[_Slice]]:
        chunks: list[list[_Slice]] = []
        current: list[_Slice] = []
        filled = 0
        for s in slices:
            if s.param.grad is None:
                continue
            joined = self.store.offset_of(s.param) is not None
            if current and (
                filled + s.numel > self.chunk_size
                or current[0].param.device != s.param.device
                or (self.store.offset_of(current[0].param) is not None) != joined
            ):
                chunks.append(current)
                current, filled = [], 0
            current.append(s)
            filled += s.numel
        if current:
            chunks.append(current)
        return chunks

    def _stage(self, chunk: list[_Slice]) -> Optional[Tensor]:
        """Point the chunk's proxies at fp32 values and gradients; the staged fp32 gradients (for clipping)."""
        first = chunk[0].param
        if self.store.offset_of(first) is None:  # fp32 parameters: the proxies are views of the parameters
            for s in chunk:
                s.proxy.data = s.param.detach().view(-1)[s.start : s.end].view(s.shape)
                s.proxy.grad = s.param.grad.detach().view(-1)[s.start : s.end].view(s.shape)
            return None
        values, grads = self.store._staging.buffers(first.device)
        if sum(s.numel for s in chunk) > values.numel():  # one row longer than chunk_size
            values = torch.empty(chunk[0].numel, device=first.device)
            grads = torch.empty(chunk[0].numel, device=first.device)
        position = 0
        for s in chunk:
            view = slice(position, position + s.numel)
            offset = self.store.offset_of(s.param)
            high, low = self.store.flat_slices(first.device, offset + s.start, offset + s.end)
            self.store.join_into(high, low, values[view])
            grads[view].copy_(s.param.grad.detach().reshape(-1)[s.start : s.end])
            s.proxy.data = values[view].view(s.shape)
            s.proxy.grad = grads[view].view(s.shape)
            position += s.numel
        return grads[:position]

    def _unstage(self, chunk: list[_Slice]) -> None:
        for s in chunk:
            offset = self.store.offset_of(s.param)
            if offset is not None:
                high, low = self.store.flat_slices(s.param.device, offset + s.start, offset + s.end)
                self.store.split_into(s.proxy.data.reshape(-1), high, low)

    def restore(self) -> None:
        """At teardown: state of a parameter held by one whole-parameter proxy moves to the parameter; per-slice
        state of parameters split across chunks cannot become one parameter's state and is dropped."""
        for slices in self.slices:
            for s in slices:
                state = self.optimizer.state.pop(s.proxy, None)
                if state is not None and s.numel == s.param.numel():
                    self.optimizer.state[s.param] = state
        for hook in self._hooks:
            hook.remove()


def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, Tensor) else copy.copy(v)) for k, v in group.items() if k != "params"}


def _put_back(group: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
            current.copy_(value)
        else:
            group[key] = copy.copy(value)
