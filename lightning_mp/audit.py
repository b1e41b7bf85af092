"""``audit``: which aten ops actually ran, in which dtype, inside which module, and how many matmul FLOPs.

A cast policy says what *should* happen; ``audit`` records what *did* happen, one training step at a time::

    census = audit(model, batch, context=torch.autocast("cpu", dtype=torch.bfloat16))
    print(census)                                  # table + "matmul FLOPs in half precision: 99.2%" + risky ops
    assert census.dtypes_of("addmm", phase="forward") == {"bfloat16"}

Every aten op call is seen by a ``TorchDispatchMode`` (below autograd and autocast, so casts and the real kernels
show up). Forward ops are attributed to the innermost running submodule through forward pre/post hooks; backward ops
to the submodule whose forward created the autograd node being run (a ``TorchFunctionMode`` tags the nodes), or
``"<backward>"`` before the first tagged node. All hooks and modes are removed when ``audit`` returns or raises.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

HALF_DTYPES = frozenset({"float16", "bfloat16"})

# Pure view / metadata ops: they move no data and compute nothing, so they are not recorded.
# Casts (``_to_copy``, ``copy_``) are recorded on purpose: where the casts happen is part of the story.
_VIEW_AND_METADATA_OPS = (
    "alias as_strided detach expand expand_as lift_fresh narrow numpy_T permute reshape _reshape_alias select slice "
    "split split_with_sizes squeeze t transpose unbind unflatten unfold unsqueeze view view_as _unsafe_view diagonal "
    "_conj _neg_view sym_size sym_stride sym_numel sym_storage_offset dim size stride"
)
IGNORED_OPS = frozenset(_VIEW_AND_METADATA_OPS.split())

# Precision-sensitive ops flagged whenever they run in half precision (losses are matched by name in _risk).
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
_MATMUL_OPS = {"mm": 0, "bmm": 0, "matmul": 0, "mv": 0, "dot": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1, "addmv": 1}
_CONV_OPS = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d"}
_CONV_TRANSPOSE_OPS = {"conv_transpose1d", "conv_transpose2d", "conv_transpose3d"}


@dataclass
class Row:
    """One unique (op, dtype, phase, module): ``count`` calls, ``flops`` matmul FLOPs summed over them."""

    op: str
    dtype: str
    phase: str
    module: str
    count: int = 0
    flops: int = 0


@dataclass
class Finding:
    """An op that ran in half precision although it is precision-sensitive; ``why`` says what goes wrong."""

    op: str
    dtype: str
    phase: str
    module: str
    why: str
    count: int = 0


def _is_half(dtype: str) -> bool:
    """``True`` when every floating input of the op was float16/bfloat16 (mixed ``"bfloat16+float32"`` is not)."""
    return all(part in HALF_DTYPES for part in dtype.split("+"))


def _in_module(name: str, prefix: str | None) -> bool:
    return prefix is None or prefix == "" or name == prefix or name.startswith(prefix + ".")


@dataclass
class Census:
    """What ran during one :func:`audit`.

    ``rows``: one :class:`Row` per unique (op, dtype, phase, module), in order of first call. ``module`` is the
    qualified name from ``named_modules()`` (``""`` for the audited module itself and for code outside any
    submodule, ``"<backward>"`` for backward ops not attributable to a module). ``dtype`` is the set of floating
    input dtypes joined by ``"+"`` (``"-"`` when the op touched no floating tensor; ``"float32"`` for CUDA's fused
    fp16-in/fp32-out ``_softmax``/``_log_softmax``, which compute in float32). ``flops`` counts only
    matmul-like ops (mm/addmm/bmm/baddbmm/matmul/linear, attention, convolution; multiply-add = 2 FLOPs).
    ``risky``: :class:`Finding` per precision-sensitive op that ran in half precision.
    """

    rows: list[Row]
    risky: list[Finding]
    large_reduction: int = 65536

    def select(
        self, op: str | Iterable[str] | None = None, phase: str | None = None, module: str | None = None
    ) -> list[Row]:
        """Rows matching all given filters: ``op`` a name or names, ``phase`` ``"forward"``/``"backward"``,
        ``module`` a module-name prefix (``"enc"`` matches ``"enc"`` and ``"enc.0"``, not ``"enc2"``)."""
        ops = {op} if isinstance(op, str) else (set(op) if op is not None else None)
        return [
            r
            for r in self.rows
            if (ops is None or r.op in ops) and (phase is None or r.phase == phase) and _in_module(r.module, module)
        ]

    def dtypes_of(self, op: str, phase: str | None = None, module: str | None = None) -> set[str]:
        """The dtypes ``op`` ran in, e.g. ``{"float32"}``; empty when it never ran (under these filters)."""
        return {r.dtype for r in self.select(op, phase, module)}

    def half_flops_fraction(
        self, ops: str | Iterable[str] | None = None, module: str | None = None, phase: str | None = None
    ) -> float:
        """Share in [0, 1] of matmul FLOPs computed in float16/bfloat16, optionally restricted to op names, a
        module-name prefix and a phase. Raises ``ValueError`` when the selection holds no matmul FLOPs at all."""
        rows = [r for r in self.select(ops, phase, module) if r.flops > 0]
        total = sum(r.flops for r in rows)
        if total == 0:
            raise ValueError(
                f"no matmul FLOPs recorded for ops={ops!r}, module={module!r}, phase={phase!r}, so there is no "
                f"fraction to take; ops with FLOPs in this census: {sorted({r.op for r in self.rows if r.flops})}"
            )
        return sum(r.flops for r in rows if _is_half(r.dtype)) / total

    def _fraction_or_none(self) -> float | None:
        return self.half_flops_fraction() if any(r.flops for r in self.rows) else None

    def summary(self) -> str:
        """``"matmul FLOPs in half precision: 99.2%"`` (or ``n/a`` when no matmul ran)."""
        fraction = self._fraction_or_none()
        if fraction is None:
            return "matmul FLOPs in half precision: n/a (no matmul FLOPs recorded)"
        return f"matmul FLOPs in half precision: {100 * fraction:.1f}%"

    def table(self) -> str:
        """A fixed-width table sorted by FLOPs then calls (both descending), the summary line and the findings."""
        header = ("op", "phase", "dtype", "calls", "GFLOPs", "module")
        ordered = sorted(self.rows, key=lambda r: (-r.flops, -r.count))
        body = [
            (r.op, r.phase, r.dtype, str(r.count), f"{r.flops / 1e9:.4g}" if r.flops else "-", r.module or "(root)")
            for r in ordered
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        right = {3, 4}  # numbers are right-aligned

        def fmt(line: tuple[str, ...]) -> str:
            cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
            return "  ".join(cells).rstrip()

        lines = [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body), "", self.summary()]
        lines.append(f"risky ops ({len(self.risky)}):" if self.risky else "risky ops: none")
        lines += [f"  {f.op} [{f.dtype}, {f.phase}] in {f.module or '(root)'} x{f.count}: {f.why}" for f in self.risky]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view: rows, risky, large_reduction and half_flops_fraction (``None`` without FLOPs)."""
        rows, risky = [asdict(r) for r in self.rows], [asdict(f) for f in self.risky]
        return {"rows": rows, "risky": risky, "large_reduction": self.large_reduction,
                "half_flops_fraction": self._fraction_or_none()}  # fmt: skip


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


def _flops(op: str, args: tuple, out: Any) -> int:
    """Matmul FLOPs of one aten call computed from shapes; 0 for ops that are not matmul-like."""
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
        transposed = op in _CONV_TRANSPOSE_OPS or (op in ("convolution", "_convolution") and bool(args[6]))
        return _conv_flops(args[0], args[1], out, transposed)
    if op == "convolution_backward":  # one forward-sized conv each for grad_input and grad_weight
        grad_out, x, weight = args[0], args[1], args[2]
        transposed, mask = bool(args[7]), args[10]  # aten passes all of convolution_backward's args positionally
        return _conv_flops(x, weight, grad_out, transposed) * (int(mask[0]) + int(mask[1]))
    return 0


# Ops whose ``half_to_float`` flag (args[2]) makes a float16 input compute and return float32: on CUDA,
# ``softmax(x_fp16, dim, dtype=torch.float32)`` (what CUDA autocast calls) runs ``_softmax(x_fp16, dim, True)``
# with no cast before it, so the input dtype alone would misreport an fp32 computation as float16.
_HALF_TO_FLOAT_OPS = frozenset({"_softmax", "_log_softmax"})


def _compute_dtype(op: str, args: tuple, kwargs: dict, out: Any) -> str:
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
    return "+".join(sorted({str(t.dtype).removeprefix("torch.") for t in chosen})) or "-"


def _risk(op: str, dtype: str, args: tuple, out: Any, large_reduction: int) -> str | None:
    """Why this half-precision call is risky, or ``None``."""
    if not _is_half(dtype):
        return None
    if "loss" in op or op.startswith(("binary_cross_entropy", "kl_div", "cross_entropy")):
        return "loss computed in half precision: its value and gradient lose precision; compute it in float32"
    if op in REDUCTION_OPS:
        inputs = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if inputs and outputs and inputs[0].numel() // max(outputs[0].numel(), 1) >= large_reduction:
            return f"reduces >= {large_reduction} elements per output in half precision; accumulate in float32"
    return SENSITIVE_OPS.get(op)


class _Recorder(TorchDispatchMode):
    """Records every non-view aten call as (op, dtype, phase, module) with counts, FLOPs and risk findings."""

    def __init__(self, large_reduction: int) -> None:
        super().__init__()
        self.large_reduction = large_reduction
        self.phase = "forward"
        self.stack: list[str] = []  # forward: qualified names of the running modules, innermost last
        self.backward_module = "<backward>"
        self.rows: dict[tuple[str, str, str, str], Row] = {}
        self.findings: dict[tuple[str, str, str, str, str], Finding] = {}

    def current_module(self) -> str:
        if self.phase == "backward":
            return self.backward_module
        return self.stack[-1] if self.stack else ""

    def enter_backward_module(self, name: str, grad_outputs: Any) -> None:  # autograd node pre-hook
        self.backward_module = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        op = func.overloadpacket.__name__
        if op not in IGNORED_OPS:
            dtype, module = _compute_dtype(op, args, kwargs, out), self.current_module()
            row = self.rows.setdefault((op, dtype, self.phase, module), Row(op, dtype, self.phase, module))
            row.count += 1
            row.flops += _flops(op, args, out)
            why = _risk(op, dtype, args, out, self.large_reduction)
            if why is not None:
                key = (op, dtype, self.phase, module, why)
                self.findings.setdefault(key, Finding(*key)).count += 1
        return out

    def census(self) -> Census:
        return Census(list(self.rows.values()), list(self.findings.values()), self.large_reduction)


class _NodeTagger(TorchFunctionMode):
    """In forward, puts a pre-hook on the autograd node of every torch-function output that tells the recorder
    which module created it, so backward ops run after that node starts are attributed to that module."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.handles: dict[Any, Any] = {}  # autograd node -> hook handle

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recorder.phase == "forward" and torch.is_grad_enabled():
            for t in tree_leaves(out):
                node = t.grad_fn if isinstance(t, torch.Tensor) else None
                if node is not None and node not in self.handles:  # first tag wins: the innermost module
                    name = self.recorder.current_module()
                    self.handles[node] = node.register_prehook(partial(self.recorder.enter_backward_module, name))
        return out

    def remove_hooks(self) -> None:
        for handle in self.handles.values():
            handle.remove()
        self.handles.clear()


def _module_hooks(root: torch.nn.Module, recorder: _Recorder) -> list[Any]:
    def push(name: str, module: torch.nn.Module, args: Any) -> None:
        recorder.stack.append(name)

    def pop(name: str, module: torch.nn.Module, args: Any, output: Any) -> None:
        if recorder.stack and recorder.stack[-1] == name:
            recorder.stack.pop()

    handles = []
    for name, sub in root.named_modules():
        handles.append(sub.register_forward_pre_hook(partial(push, name)))
        handles.append(sub.register_forward_hook(partial(pop, name), always_call=True))
    return handles


@contextlib.contextmanager
def _silenced_log(module: torch.nn.Module) -> Iterator[None]:
    """Without a Trainer (or Fabric) ``LightningModule.log`` only warns; make it a no-op meanwhile, then restore."""
    attached = getattr(module, "_trainer", None) is not None or getattr(module, "_fabric", None) is not None
    if not isinstance(module, pl.LightningModule) or attached:
        yield
        return
    had_own, previous = "log" in module.__dict__, module.__dict__.get("log")
    module.__dict__["log"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        del module.__dict__["log"]
        if had_own:
            module.__dict__["log"] = previous


def _entered(context: Any) -> contextlib.AbstractContextManager:
    if context is None:
        return contextlib.nullcontext()
    if hasattr(context, "__enter__"):  # checked first: torch.autocast is both a context manager and callable
        return context
    if callable(context):
        return context()
    raise TypeError(f"context must be None, a context manager or a factory returning one, got {context!r}")


def _forward(module: torch.nn.Module, batch: Any) -> Any:
    if isinstance(module, pl.LightningModule):
        return module.training_step(batch, 0)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    if isinstance(batch, dict):
        return module(**batch)
    return module(batch)


def _as_loss(result: Any) -> torch.Tensor:
    if isinstance(result, dict) and "loss" in result:
        result = result["loss"]
    if not isinstance(result, torch.Tensor):
        raise TypeError(
            f"backward=True needs a tensor loss (a tensor, or a dict with key 'loss'), got {type(result).__name__}"
        )
    if not result.requires_grad:
        raise ValueError(
            "backward=True, but the loss does not require grad (forward under no_grad/inference_mode, or no "
            "parameter requires grad); pass backward=False"
        )
    return result if result.dim() == 0 else result.float().sum()


def audit(
    module: torch.nn.Module,
    batch_or_callable: Any | Callable[[], Any],
    context: Any = None,
    backward: bool = True,
    large_reduction: int = 65536,
) -> Census:
    """Run one forward (and backward) of ``module`` and record every aten op: dtype, phase, module, FLOPs.

    Args:
        module: the model; its submodules are named as in ``module.named_modules()``.
        batch_or_callable: a zero-argument callable returning the loss (or an output tensor), called inside
            ``context``; or a batch: a ``LightningModule`` runs ``training_step(batch, 0)`` (no Trainer needed:
            ``self.log`` becomes a no-op meanwhile), any other module ``module(batch)`` for a tensor,
            ``module(*batch)`` for a tuple/list, ``module(**batch)`` for a dict.
        context: ``None`` (default, no extra context), a context manager (``torch.autocast("cpu",
            dtype=torch.bfloat16)``, ``plugin.forward_context()``, ``torch.inference_mode()``) or a zero-argument
            factory of one; the forward runs inside it, the backward outside (as in Lightning).
        backward: also run ``loss.backward()`` (default ``True``). The loss is the result, its ``"loss"`` key if it
            is a dict, or ``result.float().sum()`` if it is a non-scalar tensor. Gradients accumulate into
            ``.grad`` exactly as that backward leaves them; nothing is zeroed or restored.
        large_reduction: a sum/mean/norm reducing at least this many elements per output value in float16/bfloat16
            is flagged risky (default 65536 elements).

    Returns:
        a :class:`Census`. Hooks, modes and the ``log`` patch are removed also when the forward or backward raises.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(large_reduction, bool) or not isinstance(large_reduction, int) or large_reduction < 1:
        raise ValueError(f"large_reduction must be a positive int (elements), got {large_reduction!r}")
    recorder = _Recorder(large_reduction)
    tagger = _NodeTagger(recorder)
    handles = _module_hooks(module, recorder)
    try:
        with _silenced_log(module), tagger, recorder:
            with _entered(context):
                if callable(batch_or_callable):
                    result = batch_or_callable()
                else:
                    result = _forward(module, batch_or_callable)
            if backward:
                loss = _as_loss(result)
                recorder.phase = "backward"
                loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        tagger.remove_hooks()
    return recorder.census()
