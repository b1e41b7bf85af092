"""Clipping by norm for lean masters: the total norm of the gradients computed in fp32, as
``torch.nn.utils.clip_grad_norm_`` computes it on fp32 master gradients, with host work that does not grow with the
number of parameters.

Gradients are bf16 (fp32 when accumulated in fp32; fp32 for parameters kept in fp32). Each (device, dtype) group
of them is one ``_foreach_norm``: half ones with ``dtype=torch.float32``, which accumulates their fp32 values as the
norm of their fp32 copies does (the same bits), without making those copies. The per-gradient norms are then taken
in the gradients' own order, as torch's are on masters that are all fp32 (one group), so that the total norm, and
with it the clip factor, is bitwise torch's.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Optional, cast

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype


def fp32_grad_norms(grads: list[Tensor], norm_type: float, foreach: Optional[bool] = None) -> list[Tensor]:
    """The norm of order ``norm_type`` of each of ``grads``, in fp32, in their order and on the first one's device:
    one ``_foreach_norm`` per (device, dtype) group (``foreach=False``: one norm per gradient, as torch's)."""
    grouped = _group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
    first = grads[0].device
    if len(grouped) == 1:  # one device and dtype: the norms are in order already
        ((_, dtype), ([tensors], _)) = next(iter(grouped.items()))
        return _norms(cast(list[Tensor], tensors), dtype, norm_type, foreach)  # (torch types them Optional)
    norms: list[Any] = [None] * len(grads)
    for (device, dtype), ([tensors], indices) in grouped.items():
        found = _norms(cast(list[Tensor], tensors), dtype, norm_type, foreach)
        if device != first:
            found = [norm.to(first) for norm in found]
        deque(map(norms.__setitem__, indices, found), maxlen=0)  # back in the gradients' order, looped in C
    return norms


def _norms(tensors: list[Tensor], dtype: torch.dtype, norm_type: float, foreach: Optional[bool]) -> list[Tensor]:
    wide: dict[str, Any] = {} if dtype == torch.float32 else {"dtype": torch.float32}
    if foreach is False:
        return [torch.linalg.vector_norm(tensor, norm_type, **wide) for tensor in tensors]
    return list(torch._foreach_norm(tensors, norm_type, **wide))


def raise_if_nonfinite(total: Tensor, norm_type: float) -> None:
    """``clip_grad_norm_(..., error_if_nonfinite=True)``: torch's error for a non-finite total norm (a host sync)."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )


def norm_and_factor(
    optimizer: Any,
    max_norm: float,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: Optional[bool],
    total_norm: Any,
) -> tuple[Tensor, Optional[Tensor]]:
    """The total norm of ``optimizer``'s gradients (``total_norm(per-gradient fp32 norms, norm_type)``) and the clip
    factor, as ``clip_grad_norm_`` computes them on fp32 masters; the factor is ``None`` without gradients."""
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return torch.tensor(0.0), None
    with torch.no_grad():
        total = total_norm(fp32_grad_norms(grads, float(norm_type), foreach), norm_type)
        if error_if_nonfinite:
            raise_if_nonfinite(total, norm_type)
        return total, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
