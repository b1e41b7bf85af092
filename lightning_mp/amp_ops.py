"""``torch._amp_foreach_non_finite_check_and_unscale_`` for every gradient dtype on every device.

torch's CUDA kernel takes fp32 and fp16 gradients but not bf16 ("not implemented for 'BFloat16'"), which lean
masters (bf16 parameters, bf16 gradients) meet on a GPU. There, the check is the max-abs norm of each gradient
(``torch._foreach_norm`` with ``ord=inf``: one multi-tensor kernel; an inf or NaN element makes the norm inf or NaN,
and a max cannot overflow), and the unscale one ``torch._foreach_mul_``. Same flag, same values, no host sync.
"""

from __future__ import annotations

import torch
from torch import Tensor


def non_finite_check_and_unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place and set ``found_inf`` (a 1-element fp32
    tensor) to 1 if any element is inf or NaN, as ``torch._amp_foreach_non_finite_check_and_unscale_`` does."""
    if grads and grads[0].dtype == torch.bfloat16 and grads[0].device.type != "cpu":
        return check_and_unscale_by_norm_(grads, found_inf, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def check_and_unscale_by_norm_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """The same through ``torch._foreach_norm(ord=inf)`` and ``torch._foreach_mul_`` (any dtype, any device)."""
    norms = torch._foreach_norm(grads, float("inf"))
    bad = torch.stack(norms).isfinite().logical_not().any()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape)))
    torch._foreach_mul_(grads, inv_scale.reshape(()))  # computed in fp32, as torch's kernel does
