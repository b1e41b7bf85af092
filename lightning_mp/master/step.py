"""The chunked update of lean master weights: reconstruct an fp32 chunk, run torch's fused kernel on it, split back.

The weights live as a bf16 high half (the model's parameter, a view into a flat block) and an int16 remainder (a
parallel flat buffer: :mod:`lightning_mp.master.lean.blocks`); see :mod:`lightning_mp.kernels.bits`. A step walks each param group in chunks of
at most ``chunk_size`` elements. Per chunk:

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
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

#: torch's fused CPU kernels split each tensor into units of this many elements (FusedAdamKernel.cpp, grain size).
FUSED_UNIT = 32768
#: Optimizer classes whose update is done by torch's fused kernels on the lean state (exact subclasses only).
FUSED_TYPES = (AdamW, Adam, SGD)


def local_of(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded (``DTensor``) tensor, the same storage; any other tensor as it is. The update
    runs on local shards: a DTensor op here would be a collective or a reshard."""
    return getattr(tensor, "_local_tensor", tensor)


def uses_fused_kernel(optimizer: Optimizer) -> bool:
    """Whether ``optimizer``'s update runs through torch's fused kernel here (else: the generic chunked path)."""
    if type(optimizer) not in FUSED_TYPES:
        return False
    return not any(group.get("differentiable") or group.get("capturable") for group in optimizer.param_groups)


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

    def __init__(self, pieces: list[Piece], store: Any, staging: Staging, grad_ops: list[tuple[str, Any]]) -> None:
        self.pieces = pieces
        self.store = store
        first = pieces[0]
        self.joined = first.flat_offset is not None
        if self.joined:
            values, grads = staging.buffers(first.param.device)
            total = sum(p.numel for p in pieces)
            self.range = (first.flat_offset + first.start, first.flat_offset + first.start + total)
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
    for (device, _), ([group], _) in _group_tensors_by_device_and_dtype([grads]).items():  # type: ignore[list-item]
        for kind, value in grad_ops:
            if kind == "mul":
                torch._foreach_mul_(group, value.to(device))
            else:  # "clamp"
                torch._foreach_clamp_min_(group, -value)
                torch._foreach_clamp_max_(group, value)


def fp32_zeros_like(param: Tensor) -> Tensor:
    """fp32 zeros shaped (and, for a DTensor, sharded) like ``param``: a new optimizer state tensor."""
    return torch.zeros_like(param, dtype=torch.float32, memory_format=torch.contiguous_format)


def check_state_tensor(optimizer: Optimizer, param: Tensor, key: str, value: Any) -> None:
    """Refuse, by name, optimizer state that the update cannot read as torch's fused kernel reads fp32 state: a
    tensor that is not fp32, not shaped like the parameter, on another device, or not contiguous (a user's
    ``state[p]["exp_avg"] = torch.zeros_like(p)`` makes a bf16 one: lean masters keep fp32 state)."""
    local, target = local_of(value) if isinstance(value, Tensor) else value, local_of(param)
    if (
        isinstance(local, Tensor)
        and local.dtype == torch.float32
        and local.shape == target.shape
        and local.device == target.device
        and local.is_contiguous()
    ):
        return
    what = (
        f"{local.dtype} tensor of shape {tuple(local.shape)} on {local.device}"
        + ("" if local.is_contiguous() else ", not contiguous")
        if isinstance(local, Tensor)
        else repr(type(value).__name__)
    )
    index = next((i for i, g in enumerate(optimizer.param_groups) if any(p is param for p in g["params"])), "?")
    raise ValueError(
        f"master_weights='remainder': {type(optimizer).__name__}.state[param][{key!r}] of a parameter of shape "
        f"{tuple(param.shape)} in param_groups[{index}] is a {what}; the lean update keeps optimizer state in fp32, "
        f"contiguous, shaped and placed like the parameter ({tuple(target.shape)} on {target.device}), as torch's "
        f"fused optimizer reads it. Nothing was updated. Assign fp32 state, e.g. "
        f"torch.zeros_like(state[{key!r}]) or torch.zeros_like(param, dtype=torch.float32), not "
        "torch.zeros_like(param) (bf16)."
    )


def _state_for(optimizer: Optimizer, param: Tensor, keys: tuple[str, ...]) -> dict[str, Any]:
    """``optimizer.state[param]``, made as torch's Adam makes it where it is empty; each of ``keys`` checked
    (:func:`check_state_tensor`)."""
    state = optimizer.state[param]
    if not state:
        # as torch.optim.Adam/SGD initialise with fused=True: fp32 zeros shaped like the parameter (sharded like it,
        # for a DTensor), fp32 step
        state["step"] = torch.tensor(0.0, dtype=torch.float32, device=param.device)
        for key in keys:
            state[key] = fp32_zeros_like(param)
    check_state(optimizer, param, state, keys)
    return state


def check_state(optimizer: Optimizer, param: Tensor, state: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Refuse, by name, an Adam state that holds some of ``keys`` and ``step`` but not all (torch's Adam raises
    ``KeyError`` there too), and state tensors :func:`check_state_tensor` refuses."""
    for key in (*keys, "step"):
        if key not in state:
            raise KeyError(
                f"{type(optimizer).__name__}.state[param] of a parameter of shape {tuple(param.shape)} holds "
                f"{sorted(state)} but not {key!r}: torch's {type(optimizer).__name__} makes a parameter's state only "
                "where it is empty, so a partly cleared state stops its step too. Nothing was updated. Clear the "
                "whole state (optimizer.state[param].clear()) or give it every key."
            )
        if key != "step":
            check_state_tensor(optimizer, param, key, state[key])


def check_states(optimizer: Optimizer, groups: list[dict[str, Any]], stepped: Callable[[Tensor], bool]) -> None:
    """:func:`check_state` for every parameter of ``groups`` that ``stepped`` and has state (an empty one is made at
    its update), before any of them is updated: the chunked path updates group by group (and, inside backward,
    parameter by parameter), so a state met later would stop the step half-way."""
    for group in groups:
        if isinstance(optimizer, Adam):
            keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
            for param in group["params"]:
                state = optimizer.state.get(param)
                if state and stepped(param):
                    check_state(optimizer, param, state, keys)
        elif group["momentum"] != 0:  # SGD: a buffer missing or None is made from the gradient
            for param in group["params"]:
                buffer = optimizer.state.get(param, {}).get("momentum_buffer")
                if buffer is not None and stepped(param):
                    check_state_tensor(optimizer, param, "momentum_buffer", buffer)


def fused_update(
    optimizer: Optimizer,
    group: dict[str, Any],
    chunks: list[list[Piece]],
    store: Any,
    staging: Staging,
    grad_ops: list[tuple[str, Any]],
    found_inf: Optional[Tensor],
) -> None:
    """One step of ``group`` (of a ``torch.optim.Adam``/``AdamW``/``SGD``) on the lean state, chunk by chunk."""
    # every parameter with a gradient, also one whose (local) shard is empty: its state and step exist on every rank
    stepped = {id(p): p for p in group["params"] if p.grad is not None}
    if not stepped:
        return
    found = found_inf.to(torch.float32).reshape(()) if found_inf is not None else None  # 0-dim, as torch's
    if isinstance(optimizer, Adam):
        keys = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")
        states = {key: _state_for(optimizer, p, keys) for key, p in stepped.items()}
        steps = [states[key]["step"] for key in stepped]
        torch._foreach_add_(steps, 1)
        kernel = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
        beta1, beta2 = (float(b) if isinstance(b, Tensor) else b for b in group["betas"])
        lr = group["lr"]
        for chunk in chunks:
            view = ChunkView(chunk, store, staging, grad_ops)
            values, grads, exp_avgs, exp_avg_sqs, max_sqs, piece_steps = [], [], [], [], [], []
            device = chunk[0].param.device
            for piece, value, grad in zip(chunk, view.value_pieces, view.grad_pieces):
                if grad is None:
                    continue
                state = states[id(piece.param)]
                values.append(value)
                grads.append(grad)
                exp_avgs.append(local_of(state["exp_avg"]).view(-1)[piece.start : piece.end])
                exp_avg_sqs.append(local_of(state["exp_avg_sq"]).view(-1)[piece.start : piece.end])
                if group["amsgrad"]:
                    max_sqs.append(local_of(state["max_exp_avg_sq"]).view(-1)[piece.start : piece.end])
                piece_steps.append(state["step"])
            if values:
                kernel(
                    values,
                    grads,
                    exp_avgs,
                    exp_avg_sqs,
                    max_sqs,
                    piece_steps,
                    amsgrad=group["amsgrad"],
                    lr=_on(lr, device),
                    beta1=beta1,
                    beta2=beta2,
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=group["maximize"],
                    grad_scale=None,
                    found_inf=_on(found, device),
                )
            view.write_back()
        if found is not None:
            torch._foreach_sub_(steps, [_on(found, s.device) for s in steps])
        return
    # SGD: as torch.optim.SGD(fused=True), whose first step (no momentum buffers yet) copies the gradient in
    momentum = group["momentum"]
    buffers: dict[int, Tensor] = {}
    first_step = momentum != 0 and all(optimizer.state[p].get("momentum_buffer") is None for p in stepped.values())
    if momentum != 0:
        for key, param in stepped.items():
            state = optimizer.state[param]
            if state.get("momentum_buffer") is None:
                # zeros, not torch's empty_like: a first step skipped by found_inf leaves defined values behind
                state["momentum_buffer"] = fp32_zeros_like(param)
            check_state_tensor(optimizer, param, "momentum_buffer", state["momentum_buffer"])
            buffers[key] = state["momentum_buffer"]
    for chunk in chunks:
        view = ChunkView(chunk, store, staging, grad_ops)
        values, grads, bufs = [], [], []
        device = chunk[0].param.device
        for piece, value, grad in zip(chunk, view.value_pieces, view.grad_pieces):
            if grad is None:
                continue
            values.append(value)
            grads.append(grad)
            if momentum != 0:
                bufs.append(local_of(buffers[id(piece.param)]).view(-1)[piece.start : piece.end])
        if values:
            torch._fused_sgd_(
                values,
                grads,
                bufs,
                weight_decay=group["weight_decay"],
                momentum=momentum,
                lr=_on(group["lr"], device),
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                is_first_step=first_step,
                grad_scale=None,
                found_inf=_on(found, device),
            )
        view.write_back()


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, Tensor) and value.device != device else value
