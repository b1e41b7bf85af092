"""Facts about one aten call that :func:`~lightning_mp.diagnostics.audit` records: its matmul FLOPs, the dtype it
computed in, and whether running it in half precision is risky.

FLOPs come from ``torch.utils.flop_counter``'s formulas (the ones ``FlopCounterMode`` uses) for every op it counts:
mm, addmm, bmm, baddbmm, convolution / _convolution / convolution_backward and CUDA's fused attention kernels
(their backward counts the recomputed scores: 5 matmuls). One exception: torch 2.13 counts the weight gradient of a
*grouped* ``convolution_backward`` ``groups`` times over (it drops the group division; pytorch PR 183405), so a
grouped one is counted here: one forward-sized conv each for grad_input and grad_weight. What it does not count,
and ``audit`` still sees, is
counted here from shapes with the same convention (a multiply-add is 2 FLOPs): ``matmul``/``mv``/``dot``/
``addbmm``/``addmv``/``linear`` and the ``conv*d`` / ``conv_transpose*d`` composites (seen under inference mode),
``scaled_dot_product_attention`` itself, and CPU's ``_scaled_dot_product_flash_attention_for_cpu`` (forward: Q@K^T
and P@V; backward: twice the forward, recompute not counted).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from lightning_mp.diagnostics.census import is_half

# Pure view / metadata ops: they move no data and compute nothing, so they are not recorded.
# Casts (``_to_copy``, ``copy_``) are recorded on purpose: where the casts happen is part of the story.
_VIEW_AND_METADATA_OPS = (
    "alias as_strided detach expand expand_as lift_fresh narrow numpy_T permute reshape _reshape_alias select slice "
    "split split_with_sizes squeeze t transpose unbind unflatten unfold unsqueeze view view_as _unsafe_view diagonal "
    "_conj _neg_view sym_size sym_stride sym_numel sym_storage_offset dim size stride"
)
IGNORED_OPS = frozenset(_VIEW_AND_METADATA_OPS.split())

# Precision-sensitive ops flagged whenever they run in half precision (losses are matched by name in risk).
_LOG_SOFTMAX = "log-softmax in half precision loses the small log-probabilities; compute it in float32"
_NORM = "a norm squares and sums its input: overflow and rounding in half precision"
SENSITIVE_OPS = {
    "_log_softmax": _LOG_SOFTMAX,
    "log_softmax": _LOG_SOFTMAX,
    "logsumexp": "logsumexp in half precision loses precision; compute it in float32",
    "exp": "exp overflows float16 above ~11 and rounds coarsely in half precision",
    "pow": "pow overflows / underflows easily in half precision",
    "norm": _NORM,
    "linalg_vector_norm": _NORM,
    "cumsum": "a running sum accumulates rounding error in half precision",
    "cumprod": "a running product overflows / underflows in half precision",
}
REDUCTION_OPS = frozenset({"sum", "mean", "nansum", "norm", "linalg_vector_norm"})
# matmul-like ops torch.utils.flop_counter does not count: operand index of the first matrix
_MATMUL_OPS = {"matmul": 0, "mv": 0, "dot": 0, "addbmm": 1, "addmv": 1}
_CONV_OPS = {"conv1d", "conv2d", "conv3d"}
_CONV_TRANSPOSE_OPS = {"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}


def _matmul_flops(a: torch.Tensor, b: torch.Tensor) -> int:
    """2*m*k*n per (broadcast) batch for ``(..., m, k) @ (..., k, n)``; 1-D operands count as m=1 / n=1."""
    m = a.shape[-2] if a.dim() > 1 else 1
    n = b.shape[-1] if b.dim() > 1 else 1
    batch = math.prod(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    return 2 * batch * m * a.shape[-1] * n


def _conv_flops(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, transposed: bool) -> int:
    """2 * out_numel * (in_channels/groups) * prod(kernel); for a transposed conv the roles of input and output
    swap (weight is (in, out/groups, *kernel)), so it is 2 * in_numel * (out_channels/groups) * prod(kernel)."""
    per_position = weight.shape[1] * math.prod(weight.shape[2:])
    return 2 * (x.numel() if transposed else out.numel()) * per_position


def _attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Q@K^T plus P@V for q (..., s_q, d), k (..., s_k, d), v (..., s_k, d_v): 2*B*s_q*s_k*(d + d_v), B = q's
    leading dims (batch * heads); with d_v == d this is 4*b*h*s_q*s_k*d."""
    return 2 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def matmul_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    """Matmul FLOPs of one aten call ``func(*args, **kwargs) -> out``; 0 for ops that are not matmul-like."""
    op = func.overloadpacket.__name__
    if op == "convolution_backward" and args[9] != 1:  # grouped: see the module docstring
        grad_out, x, weight, transposed, mask = args[0], args[1], args[2], bool(args[7]), args[10]
        return _conv_flops(x, weight, grad_out, transposed) * (int(mask[0]) + int(mask[1]))
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        return int(formula(*args, **kwargs, out_val=out))
    if op in _MATMUL_OPS:
        first = _MATMUL_OPS[op]
        return _matmul_flops(args[first], args[first + 1])
    if op == "linear":
        weight = args[1]
        return 2 * args[0].numel() * (weight.shape[0] if weight.dim() > 1 else 1)
    if op.startswith(("_scaled_dot_product", "scaled_dot_product_attention")):
        if op.endswith("_backward"):  # grads of Q, K, V and the scores: twice the forward (recompute not counted)
            return 2 * _attention_flops(args[1], args[2], args[3])
        return _attention_flops(args[0], args[1], args[2])
    if op in _CONV_OPS or op in _CONV_TRANSPOSE_OPS:
        return _conv_flops(args[0], args[1], out, transposed=op in _CONV_TRANSPOSE_OPS)
    return 0


# Ops whose ``half_to_float`` flag (args[2]) makes a float16 input compute and return float32: on CUDA,
# ``softmax(x_fp16, dim, dtype=torch.float32)`` (what CUDA autocast calls) runs ``_softmax(x_fp16, dim, True)``
# with no cast before it, so the input dtype alone would misreport an fp32 computation as float16.
_HALF_TO_FLOAT_OPS = frozenset({"_softmax", "_log_softmax"})


def compute_dtype(op: str, args: tuple, kwargs: dict, out: Any) -> str:
    """Floating input dtypes joined by "+". 0-dim inputs are ignored when dimensioned ones exist (as in PyTorch's
    type promotion, a 0-dim float32 tensor does not make a bfloat16 op compute in float32). With no floating input,
    the floating output dtypes; "-" when there are none either. ``_softmax``/``_log_softmax`` with
    ``half_to_float=True`` compute in float32 (their output dtype) and are reported as such."""
    if op in _HALF_TO_FLOAT_OPS and (args[2] if len(args) > 2 else kwargs.get("half_to_float")) is True:
        return "float32"
    floats = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    chosen = [t for t in floats if t.dim() > 0] or floats
    if not chosen:
        chosen = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return "+".join(sorted({_stored_dtype(t) for t in chosen})) or "-"


def _stored_dtype(tensor: torch.Tensor) -> str:
    """The dtype a tensor's values are held in: a torchao ``Float8TrainingTensor`` (an fp8 matmul operand, whose
    ``dtype`` is its original high precision) reports the fp8 dtype of its ``_data``; others their ``dtype``."""
    data = getattr(tensor, "_data", None) if type(tensor) is not torch.Tensor else None
    dtype = data.dtype if isinstance(data, torch.Tensor) and data.dtype.itemsize == 1 else tensor.dtype
    return str(dtype).removeprefix("torch.")


def risk(op: str, dtype: str, args: tuple, out: Any, large_reduction: int) -> str | None:
    """Why this half-precision call is risky, or ``None``."""
    if not is_half(dtype):
        return None
    if "loss" in op or op.startswith(("binary_cross_entropy", "kl_div", "cross_entropy")):
        return "loss computed in half precision: its value and gradient lose precision; compute it in float32"
    if op in REDUCTION_OPS:
        inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if inputs and outputs and inputs[0].numel() // max(outputs[0].numel(), 1) >= large_reduction:
            return f"reduces >= {large_reduction} elements per output in half precision; accumulate in float32"
    return SENSITIVE_OPS.get(op)
