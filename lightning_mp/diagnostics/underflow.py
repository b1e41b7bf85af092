"""Per-layer gradient statistics against fp16's range, computed on the device and read with one host sync.

For each gradient tensor ``g`` (already unscaled, as the optimizer sees it) and the loss scale ``s`` it was produced
with, the values that fp16 held during backward were ``g * s``. Counted per tensor:

- ``zeros``: ``g == 0`` (true zeros and values that already flushed to zero in fp16);
- ``flush``: ``0 < |g * s| < 2**-24`` (below fp16's smallest subnormal: they round to zero in fp16);
- ``subnormal``: ``2**-24 <= |g * s| < 2**-14`` (fp16 subnormals: fewer than 10 significant bits);
- ``nonfinite``: inf or NaN;
- ``amax``: ``max |g * s|`` over the tensor (inf when a value is non-finite), from which the headroom before
  fp16 overflow is ``log2(65504 / amax)`` powers of two.

With a power-of-two scale (what dynamic scaling uses) ``g * s`` is exact, so the counts are exact. The thresholds
are divided by ``s`` on the device (``s`` may be the scaler's device tensor), so nothing waits for the device until
:func:`read_rows` turns every tensor's row into Python floats in one transfer. For bf16 (same exponent range as
fp32) only ``zeros`` and ``amax`` mean something; the report shows only those.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn

FP16_MIN_NORMAL = 2.0**-14
FP16_MIN_SUBNORMAL = 2.0**-24

Scale = Union[float, Tensor]


def _local(tensor: Tensor) -> Tensor:
    # a DTensor (FSDP2) is counted on its local shard; counts are summed across ranks by `reduce_rows`
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tensor_stats(grad: Tensor, scale: Scale = 1.0) -> Tensor:
    """One row ``[numel, zeros, flush, subnormal, nonfinite, amax]`` (fp32, on ``grad``'s device) for ``grad``
    unscaled by ``scale``: see the module docstring. No host synchronisation."""
    grad = _local(grad.detach())
    if grad.is_sparse:
        grad = grad.coalesce()._values()
    magnitude = grad.abs()
    factor: Scale = scale.to(device=grad.device, dtype=torch.float32) if isinstance(scale, Tensor) else float(scale)
    low_normal, low_subnormal = FP16_MIN_NORMAL / factor, FP16_MIN_SUBNORMAL / factor
    unit_scale = not isinstance(factor, Tensor) and factor == 1.0
    if magnitude.dtype in (torch.float16, torch.bfloat16) and not unit_scale:
        # the thresholds divided by the scale may lie below half precision's range: compare in fp32
        magnitude = magnitude.float()
    zeros = (magnitude == 0).sum()
    below_subnormal = (magnitude < low_subnormal).sum()
    below_normal = (magnitude < low_normal).sum()
    nonfinite = magnitude.numel() - torch.isfinite(magnitude).sum()
    amax = magnitude.amax().float() if magnitude.numel() else torch.zeros((), device=grad.device)
    numel = torch.full((), float(magnitude.numel()), device=grad.device)
    return torch.stack(
        [
            numel,
            zeros.float(),
            (below_subnormal - zeros).float(),
            (below_normal - below_subnormal).float(),
            nonfinite.float(),
            amax * factor,
        ]
    )


def grouped_stats(named_grads: Sequence[tuple[str, Tensor]], scale: Scale = 1.0) -> tuple[list[str], Tensor]:
    """Stats of several gradients summed into groups (amax: the largest) on the device: ``(group names,
    tensor of shape (groups, 6))``. ``named_grads`` holds ``(group, gradient)`` pairs; a group appears once, in
    first-seen order."""
    groups: dict[str, list[Tensor]] = {}
    for group, grad in named_grads:
        groups.setdefault(group, []).append(tensor_stats(grad, scale))
    rows = []
    for parts in groups.values():
        stacked = torch.stack([part.to(parts[0].device) for part in parts])
        rows.append(torch.cat([stacked[:, :5].sum(0), stacked[:, 5:].amax(0)]))
    if not rows:
        return [], torch.zeros(0, 6)
    device = rows[0].device
    return list(groups), torch.stack([row.to(device) for row in rows])


def reduce_rows(rows: Tensor) -> Tensor:
    """Across ranks, where a process group is initialised: counts summed, ``amax`` the largest. Identity
    otherwise. (Under DDP the gradients are already identical on every rank: shares and amax are unchanged.)"""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return rows
    if torch.distributed.get_world_size() < 2:
        return rows
    counts, amax = rows[:, :5].contiguous(), rows[:, 5:].contiguous()
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM)
    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
    return torch.cat([counts, amax], dim=1)


def read_rows(*tables: Tensor) -> list[list[list[float]]]:
    """Every table's rows as Python floats, in one device->host transfer (the sample's one host sync); tables may
    differ in width."""
    non_empty = [table for table in tables if len(table)]
    if not non_empty:
        return [[] for _ in tables]
    device = non_empty[0].device
    flat = torch.cat([table.to(device).reshape(-1) for table in non_empty]).tolist()
    out, start = [], 0
    for table in tables:
        width = table.shape[1] if table.dim() == 2 else 1
        out.append([flat[start + i * width : start + (i + 1) * width] for i in range(len(table))])
        start += len(table) * width
    return out


def module_of(param_name: str) -> str:
    """``"encoder.layer.0.attention.self.query"`` for ``"encoder.layer.0.attention.self.query.weight"``."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


class ActivationGradStats:
    """Statistics of the gradients flowing into every leaf module's outputs, for the micro-batches it is armed on.

    :meth:`arm` puts a forward hook on each leaf module that registers a tensor hook on its floating outputs;
    the tensor hook adds the gradient's stats (in the dtype autograd holds it, scaled: no division by the scale)
    to that module's device accumulator. :meth:`disarm` removes the forward hooks. Nothing runs while disarmed.
    """

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._rows: dict[str, Tensor] = {}
        self._order: list[str] = []  # leaf modules in model order: the same on every rank (rows are reduced)

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def arm(self, model: nn.Module) -> None:
        if self._handles:
            return
        self._order = []
        for name, module in model.named_modules():
            if next(module.children(), None) is None:
                self._order.append(name)
                self._handles.append(module.register_forward_hook(self._forward_hook(name)))

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            for tensor in outputs:
                if isinstance(tensor, Tensor) and tensor.is_floating_point() and tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._add(name, grad))

        return hook

    def _add(self, name: str, grad: Tensor) -> None:
        row = tensor_stats(grad)
        previous = self._rows.get(name)
        if previous is not None:
            row = torch.cat([previous[:5] + row[:5].to(previous.device), torch.maximum(previous[5:], row[5:])])
        self._rows[name] = row

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take(self) -> tuple[list[str], Tensor]:
        """The accumulated ``(module names, rows)`` (on the device, in model order), and start afresh."""
        names = [name for name in self._order if name in self._rows]
        rows = [self._rows[name] for name in names]
        self._rows = {}
        if not rows:
            return [], torch.zeros(0, 6)
        return names, torch.stack([row.to(rows[0].device) for row in rows])


def param_groups_grads(optimizer: Any, names: dict[int, str]) -> list[tuple[str, Tensor]]:
    """``(module name, gradient)`` for every parameter of ``optimizer`` that has a gradient; ``names`` maps
    ``id(param)`` to its qualified name (unnamed parameters are grouped as ``"(unnamed)"``)."""
    pairs = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                name = names.get(id(param))
                pairs.append((module_of(name) if name is not None else "(unnamed)", param.grad))
    return pairs


def scale_tensor(scaler: Optional[Any]) -> Scale:
    """The scale the current gradients carry: our scaler's device tensor (no sync), else 1."""
    if scaler is None or not getattr(scaler, "enabled", False) or getattr(scaler, "check_only", False):
        return 1.0
    scale_of_grads = getattr(scaler, "scale_of_grads", None)
    return scale_of_grads() if callable(scale_of_grads) else 1.0


def names_of_params(model: nn.Module, masters: Optional[Any] = None) -> dict[int, str]:
    """``id(param) -> qualified name`` for the model's parameters and, with master weights, their fp32 masters."""
    names = {id(param): name for name, param in model.named_parameters()}
    if masters is not None:
        for param, master in masters.pairs():
            if id(param) in names:
                names[id(master)] = names[id(param)]
    return names
