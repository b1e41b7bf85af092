"""The chunked update of lean master weights: reconstruct an fp32 chunk, run torch's fused kernel on it, split back.

The weights live as a bf16 high half (the model's parameter, a view into a flat block) and an int16 remainder (a
parallel flat buffer: :mod:`lightning_mp.master.lean.blocks`); see :mod:`lightning_mp.kernels.bits`. A step walks each
param group in chunks of at most ``chunk_size`` elements. Per chunk:

1. join: the chunk's bf16 weights and remainders become exact fp32 values in a staging buffer (one pass over a
   contiguous range of the flat buffers);
2. gradients: each piece's gradient (bf16 at rest, fp32 when accumulated in fp32) is copied, upcast, into a
   staging gradient buffer, and any clipping Lightning asked for is applied there, in fp32, as
   ``torch.nn.utils.clip_grad_norm_`` applies it to fp32 master gradients;
3. update: torch's own fused kernel (``torch._fused_adamw_`` / ``_fused_adam_`` / ``_fused_sgd_``) on the staging
   pieces and the optimizer's fp32 state tensors, with ``found_inf`` (a device tensor: nonzero leaves everything
   unchanged, no host synchronisation) exactly as ``torch.optim.AdamW(fused=True)`` calls it;
4. split: the staging values go back into the bf16 weights and remainders.

Exactness: the fused kernels process each tensor in units of 32768 elements starting at the tensor's first
element; a chunk's pieces start at multiples of ``chunk_size`` (itself a multiple of 32768) inside each parameter,
so every element goes through the same code path (vector body or scalar tail) as in torch's fused optimizer on
the whole fp32 parameter. The result is bitwise that of ``torch.optim.AdamW/Adam/SGD(..., fused=True)`` on fp32
parameters holding the joined values, given the same gradients (see tests/test_lean_masters.py).

Transient memory: two fp32 staging buffers of ``chunk_size`` elements (8 bytes x ``chunk_size``) plus the split's
int32 temporaries of one chunk (at most 4 bytes x ``chunk_size`` more at a time): 3 MiB for CPU's default 2**18
elements, 384 MiB for a GPU's 2**25, whatever the model size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

from lightning_mp.master.lean.interface import LeanStore
from lightning_mp.master.lean.optimizers import Entry, local_of, state_for

#: torch's fused CPU kernels split each tensor into units of this many elements (FusedAdamKernel.cpp, grain size).
FUSED_UNIT = 32768


@dataclass
class Piece:
    """Elements ``[start, end)`` of a parameter (flattened); ``flat_offset`` is where the parameter starts in its
    device's flat buffers, ``None`` for a parameter kept in fp32 (no remainder: updated in place)."""

    param: Tensor
    start: int
    end: int
    flat_offset: Optional[int]

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_chunks(params: list[Tensor], offsets: dict[int, Optional[int]], chunk_size: int) -> list[list[Piece]]:
    """Group ``params`` (in order) into chunks of at most ``chunk_size`` elements, each a list of pieces.

    A parameter larger than ``chunk_size`` is cut at multiples of ``chunk_size`` from its start; the pieces of one
    chunk are consecutive in the flat buffers, so a chunk joins and splits as one range. Parameters kept in fp32
    are their own chunks (nothing to join).
    """
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for param in params:
        offset = offsets[id(param)]
        numel = local_of(param).numel()
        for start in range(0, numel, chunk_size):
            piece = Piece(param, start, min(start + chunk_size, numel), offset)
            contiguous = (
                current
                and offset is not None
                and current[-1].flat_offset is not None
                and current[-1].flat_offset + current[-1].end == offset + start
                and current[-1].param.device == param.device
            )
            if current and (filled + piece.numel > chunk_size or not contiguous):
                chunks.append(current)
                current, filled = [], 0
            current.append(piece)
            filled += piece.numel
    if current:
        chunks.append(current)
    return chunks


class Staging:
    """The two fp32 staging buffers of a device (values and gradients), ``chunk_size_for(device)`` elements each."""

    def __init__(self, chunk_size_for: Callable[[torch.device], int]) -> None:
        self.chunk_size_for = chunk_size_for
        self._buffers: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def buffers(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._buffers:
            size = self.chunk_size_for(device)
            self._buffers[device] = (
                torch.empty(size, dtype=torch.float32, device=device),
                torch.empty(size, dtype=torch.float32, device=device),
            )
        return self._buffers[device]

    def release(self) -> None:
        self._buffers.clear()


class ChunkView:
    """One chunk made fp32: the values (joined, or the fp32 parameter itself) and the gradients, as piece lists."""

    def __init__(
        self, pieces: list[Piece], store: LeanStore, staging: Staging, grad_ops: list[tuple[str, Any]]
    ) -> None:
        self.pieces = pieces
        self.store = store
        first = pieces[0]
        offset = first.flat_offset
        self.joined = offset is not None
        if offset is not None:
            values, grads = staging.buffers(first.param.device)
            total = sum(p.numel for p in pieces)
            self.range = (offset + first.start, offset + first.start + total)
            self.values = values[:total]
            high, low = store.flat_slices(first.param.device, *self.range)
            store.codec.join_into(high, low, self.values)
            self.grads_flat = grads[:total]
            self.value_pieces, self.grad_pieces = [], []
            position = 0
            for piece in pieces:
                view = slice(position, position + piece.numel)
                self.value_pieces.append(self.values[view])
                grad = piece.param.grad
                if grad is not None:
                    self.grads_flat[view].copy_(local_of(grad).detach().reshape(-1)[piece.start : piece.end])
                self.grad_pieces.append(self.grads_flat[view] if grad is not None else None)
                position += piece.numel
            apply_grad_ops(self.grads_flat, grad_ops)
        else:  # an fp32 parameter: updated in place; its gradient was clipped in place before the chunks
            self.value_pieces = [local_of(p.param).detach().view(-1)[p.start : p.end] for p in pieces]
            self.grad_pieces = [
                local_of(p.param.grad).detach().view(-1)[p.start : p.end] if p.param.grad is not None else None
                for p in pieces
            ]

    def write_back(self) -> None:
        if self.joined:
            high, low = self.store.flat_slices(self.pieces[0].param.device, *self.range)
            self.store.codec.split_into(self.values, high, low)


def apply_grad_ops(grads: Tensor, grad_ops: list[tuple[str, Any]]) -> None:
    """Clipping deferred from Lightning's hooks, applied to fp32 gradients as torch applies it to fp32 masters."""
    for kind, value in grad_ops:
        if kind == "mul":
            grads.mul_(value.to(grads.device))
        else:  # "clamp", as torch.nn.utils.clip_grad_value_
            grads.clamp_min_(-value).clamp_max_(value)


def apply_grad_ops_in_place(params: list[Tensor], grad_ops: list[tuple[str, Any]]) -> None:
    """The same deferred clipping on gradients that are updated in place (fp32 parameters): one foreach op per
    clipping and (device, dtype) group, as ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` apply it."""
    if not grad_ops:
        return
    grads = [
        local_of(p.grad)
        for p in params
        if p.grad is not None and p.grad.dtype == torch.float32 and p.dtype == torch.float32
    ]
    if not grads:
        return
    for (device, _), ([listed], _) in _group_tensors_by_device_and_dtype([grads]).items():  # type: ignore[list-item]
        group = cast(list[Tensor], listed)  # (torch types the grouped lists Optional: these are the gradients)
        for kind, value in grad_ops:
            if kind == "mul":
                torch._foreach_mul_(group, value.to(device))
            else:  # "clamp"
                torch._foreach_clamp_min_(group, -value)
                torch._foreach_clamp_max_(group, value)


def update(
    entry: Entry,
    optimizer: Optimizer,
    group: dict[str, Any],
    chunks: list[list[Piece]],
    store: LeanStore,
    staging: Staging,
    grad_ops: list[tuple[str, Any]],
    found_inf: Optional[Tensor],
) -> None:
    """One update of ``group`` on the lean state, chunk by chunk, by the function of ``optimizer``'s table entry
    (:mod:`.optimizers`): its state made and checked for every stepped parameter first, then per chunk the fp32
    values joined, the function run on the pieces with their state slices, the values split back."""
    # every parameter with a gradient, also one whose (local) shard is empty: its state and step exist on every rank
    stepped = {id(p): p for p in group["params"] if p.grad is not None}
    if not stepped:
        return
    found = found_inf.to(torch.float32).reshape(()) if found_inf is not None else None  # 0-dim, as torch's
    if entry.skips_on_host and found is not None and bool(found):
        return  # torch's function takes no found_inf: skipped as GradScaler.step skips the optimizer's step()
    first_step = entry.first_step(optimizer, group, list(stepped.values()))
    states = {key: state_for(entry, optimizer, p, group) for key, p in stepped.items()}
    names = [name for name, _ in entry.scalars]
    if entry.counts_steps:
        steps = [states[key]["step"] for key in stepped]
        torch._foreach_add_(steps, 1)
    # the function advances its scalars itself: each piece of a parameter gets a copy of the values before this
    # update, and the parameter's state the advanced copy (a parameter cut into pieces advances once)
    before = {} if entry.counts_steps else {k: [s[n].clone() for n in names] for k, s in states.items()}
    advanced: dict[int, list[Tensor]] = {}
    keys = entry.keys(group)
    for chunk in chunks:
        view = ChunkView(chunk, store, staging, grad_ops)
        values, grads = [], []
        tensors: list[list[Tensor]] = [[] for _ in keys]
        scalars: list[list[Tensor]] = [[] for _ in names]
        device = chunk[0].param.device
        for piece, value, grad in zip(chunk, view.value_pieces, view.grad_pieces):
            if grad is None:
                continue
            state = states[id(piece.param)]
            values.append(value)
            grads.append(grad)
            for listed, key in zip(tensors, keys):
                listed.append(local_of(state[key]).view(-1)[piece.start : piece.end])
            own = [state[n] for n in names] if entry.counts_steps else [t.clone() for t in before[id(piece.param)]]
            advanced[id(piece.param)] = own
            for listed, tensor in zip(scalars, own):
                listed.append(tensor)
        if values:
            entry.run(group, values, grads, tensors, scalars, _on(group["lr"], device), _on(found, device), first_step)
        view.write_back()
    if entry.counts_steps and found is not None:
        torch._foreach_sub_(steps, [_on(found, s.device) for s in steps])
    if not entry.counts_steps:
        for param_id, own in advanced.items():
            for name, tensor in zip(names, own):
                states[param_id][name].copy_(tensor)


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) and value.device != device else value
