"""Find where the inf/NaN that reached the loss or the gradients was born: the operation, its module, the phase.

:class:`NonFiniteTrace` is a context manager that, while active, checks every aten operation (views excepted):
which kinds of non-finite values (NaN, +inf, -inf) its floating inputs and outputs hold, and the largest finite
magnitude among its inputs. It also records which earlier operation produced each input (a view counts as its
base), so the operations form a data-flow graph. The checks stay on the device; :meth:`NonFiniteTrace.origin` reads
them all with one host sync.

Models produce non-finite values on purpose: attention masks built with ``-inf`` (``masked_fill``, ``full``,
``triu``), additive masks of ``finfo.min`` that overflow to ``-inf`` in fp16, ``log(0)`` buckets. They die in the
softmax (or ``where``) that follows and never reach the loss. So an origin is defined from the values that matter:
given the *roots* (the loss, or the gradients), :meth:`~NonFiniteTrace.origin` walks back from the non-finite roots
through the operations whose outputs were non-finite, and returns the first (in execution order) of those
operations that created a kind of non-finite value its inputs did not hold (``x * 1e5`` overflowing to ``inf``;
``inf - inf`` making NaN; ``softmax`` of a row that is ``-inf`` everywhere making NaN). Operations of the roots' own
phase come first (for gradients: the backward). Failing such an operation, the first that read inf/NaN from outside
the trace (data, parameters), then one that writes a non-finite constant on purpose (``masked_fill(mask, -inf)``;
arithmetic with a non-finite constant, ``x * inf``, is an ordinary origin).
Non-finite values that never reach a root are by design and are never an origin.

Each operation is credited to a module: in forward, the innermost module running (forward pre/post hooks; code in
the module's own forward hooks and pre-hooks, registered before the trace starts, counts as the module's); in
backward, the module whose forward created the autograd node being run (``torch._C._current_autograd_node()``,
mapped to modules by a ``TorchFunctionMode`` during forward), which also credits code in a tensor hook registered on
a module's output to that module. Everything is removed when the context exits. Only used to replay a skipped step:
it costs a few extra kernels per operation.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_mp.diagnostics.aten_ops import IGNORED_OPS

OUTSIDE = "(outside any module)"
#: ops that write a non-finite constant on purpose when given one (``masked_fill(mask, -inf)``, ``full(..., -inf)``,
#: ``where(mask, x, -inf)``): an attention mask, not an origin. Arithmetic with a non-finite constant (``x * inf``, in
#: a forward hook say) computes non-finite values: an origin like any other op
CONSTANT_WRITERS = frozenset(
    {
        "masked_fill",
        "masked_fill_",
        "fill",
        "fill_",
        "full",
        "full_like",
        "new_full",
        "where",
        "index_fill",
        "index_fill_",
        "scalar_tensor",
        "clamp",
        "clamp_min",
        "clamp_max",
    }
)
#: ops that return uninitialised memory (whatever bits were there, NaN included): never checked
UNINITIALISED_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "empty_permuted"}
)


@dataclass(frozen=True)
class Origin:
    """Where a non-finite value was first produced. ``input_amax`` is the largest finite magnitude among the
    operation's floating inputs (``0.0`` when it had none)."""

    phase: str
    module: str
    module_class: str
    op: str
    input_amax: float


def _leaves(value: Any) -> Iterator[Any]:
    """The leaves of nested tuples, lists and dicts (aten arguments and results; cheaper than pytree)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _floats(value: Any) -> list[Tensor]:
    return [
        t
        for t in _leaves(value)
        if isinstance(t, Tensor) and t.is_floating_point() and not t.is_sparse and t.numel() > 0
    ]


def _nonfinite_constant(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, float) and not math.isfinite(v) for v in _leaves((args, kwargs)))


def _extremes(tensors: list[Tensor]) -> list[Tensor]:
    """Each tensor's smallest and largest value (NaN when it holds a NaN): all the checks need, one kernel each."""
    return [extreme for t in tensors for extreme in torch.aminmax(t.detach())]


def _kinds(extremes: list[float]) -> tuple[bool, bool, bool]:
    """(holds NaN, holds +inf, holds -inf) of tensors given as their [min, max, min, max, ...]. A tensor holding
    NaN reads as NaN only (``aminmax`` propagates NaN)."""
    nan = pos = neg = False
    for low, high in zip(extremes[::2], extremes[1::2]):
        if math.isnan(low) or math.isnan(high):
            nan = True
        else:
            pos, neg = pos or high == math.inf, neg or low == -math.inf
    return nan, pos, neg


def _finite_amax(extremes: list[float]) -> float:
    """The largest finite magnitude among the extremes (exact for finite tensors)."""
    return max((abs(v) for v in extremes if math.isfinite(v)), default=0.0)


class _Checks(TorchDispatchMode):
    def __init__(self, trace: NonFiniteTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        trace = self.trace
        if trace.paused or op in UNINITIALISED_OPS:
            return func(*args, **kwargs)
        if op in IGNORED_OPS:  # a view: its values are its base's, produced by the base's producer
            out = func(*args, **kwargs)
            trace._alias(args, out)
            return out
        inputs = _floats((args, kwargs))
        # inputs are checked before the op runs: an in-place op overwrites them
        in_extremes = _extremes(inputs)
        parents = [trace._producer.get(t) for t in inputs]
        out = func(*args, **kwargs)
        outputs = _floats(out)
        if outputs:
            trace._record(
                op, in_extremes, parents, outputs, op in CONSTANT_WRITERS and _nonfinite_constant(args, kwargs)
            )
        return out


class _NodeModules(TorchFunctionMode):
    """During forward: remembers which module created each autograd node."""

    def __init__(self, trace: NonFiniteTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.trace.phase == "forward" and torch.is_grad_enabled():
            for t in _leaves(out):
                node = t.grad_fn if isinstance(t, Tensor) else None
                if node is not None and node not in self.trace.node_modules:  # innermost module wins
                    self.trace.node_modules[node] = self.trace.current_module()
        return out


@dataclass(frozen=True)
class _Row:
    """What one operation's floating inputs and outputs held: kinds are (NaN, +inf, -inf); ``leaf_bad``: an input
    that no traced operation produced (data, parameters, tensors made before the trace) held inf/NaN."""

    in_kinds: tuple[bool, bool, bool]
    out_kinds: tuple[bool, bool, bool]
    input_amax: float
    leaf_bad: bool

    @property
    def out_bad(self) -> bool:
        return any(self.out_kinds)

    @property
    def born(self) -> bool:
        """The output holds a kind of non-finite value (NaN, +inf, -inf) that no input held."""
        return any(out and not held for out, held in zip(self.out_kinds, self.in_kinds))


class NonFiniteTrace:
    """Context manager: check every operation of a forward (and backward) run inside it for inf/NaN.

    Args:
        model: the module whose submodules are named (``model.named_modules()``).
        device: where the per-operation flags are gathered (the model's device).

    Set :attr:`phase` to ``"backward"`` before running the backward. After exit, :meth:`origin` gives the
    :class:`Origin` or ``None`` (one host sync), :attr:`operations` the number of operations checked.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.phase = "forward"
        self.stack: list[str] = []
        self.node_modules: dict[Any, str] = {}
        self._last_backward_module = OUTSIDE
        self._ops: list[tuple[str, str, str, bool]] = []  # (op, phase, module, writes a non-finite constant)
        self._flags: list[Tensor] = []  # per op: [min, max] of each floating input, then of each floating output
        self._inputs: list[list[Optional[int]]] = []  # per op and floating input: the traced op that produced it
        self._parents: list[list[int]] = []  # per op: the traced ops that produced its floating inputs
        self._producer: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # live tensor -> op that produced it
        self._classes = {name: type(module).__name__ for name, module in model.named_modules()}
        self._handles: list[Any] = []
        self._modes: list[Any] = []
        self.paused = False  # while reading the flags: those ops are ours, not the model's
        self._dtype = torch.float32 if device.type == "mps" else torch.float64  # MPS has no float64

    @property
    def operations(self) -> int:
        return len(self._ops)

    def current_module(self) -> str:
        if self.phase == "forward":
            return self.stack[-1] if self.stack else OUTSIDE
        node = torch._C._current_autograd_node()
        module = self.node_modules.get(node) if node is not None else None
        if module is not None:
            self._last_backward_module = module
        return self._last_backward_module  # nodes made below torch functions (autocast's casts): the consumer's

    def _record(
        self, op: str, in_extremes: list[Tensor], parents: list[Optional[int]], outputs: list[Tensor], constant: bool
    ) -> None:
        index = len(self._ops)
        # on the trace's device (a CPU scalar may join a CUDA op), in float64 (a float64 value above float32's range
        # is not an inf)
        extremes = [e.to(self.device, self._dtype) for e in (*in_extremes, *_extremes(outputs))]
        self._flags.append(torch.stack(extremes))
        self._inputs.append(parents)
        self._parents.append(sorted({parent for parent in parents if parent is not None}))
        self._ops.append((op, self.phase, self.current_module(), constant))
        for tensor in outputs:
            self._producer[tensor] = index

    def _alias(self, args: Any, out: Any) -> None:
        base = next((t for t in _leaves(args) if isinstance(t, Tensor)), None)
        parent = self._producer.get(base) if base is not None else None
        if parent is None:
            return
        for tensor in _leaves(out):
            if isinstance(tensor, Tensor):
                self._producer[tensor] = parent

    # ------------------------------------------------------------------ context
    def __enter__(self) -> NonFiniteTrace:
        for name, module in self.model.named_modules():
            # before the module's own pre-hooks and after its forward hooks: code in a hook belongs to the hooked module
            self._handles.append(module.register_forward_pre_hook(partial(self._push, name), prepend=True))
            self._handles.append(module.register_forward_hook(partial(self._pop, name), always_call=True))
        self._modes = [_NodeModules(self), _Checks(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(None, None, None)
        self._modes = []
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.node_modules.clear()

    def _push(self, name: str, module: nn.Module, args: Any) -> None:
        self.stack.append(name)

    def _pop(self, name: str, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1] == name:
            self.stack.pop()

    # ------------------------------------------------------------------ results
    def flags(self, roots: Sequence[Tensor] = ()) -> tuple[list[_Row], list[bool]]:
        """Per operation what its inputs and outputs held (:class:`_Row`), and per root whether it holds inf/NaN:
        one host sync."""
        if not self._flags and not roots:
            return [], []
        self.paused = True
        try:
            sizes = [len(flags) for flags in self._flags]
            values = torch.cat(self._flags).tolist() if self._flags else []
            bad = (
                torch.stack([(~torch.isfinite(r.detach()).all()).to(self.device) for r in roots]).tolist()
                if roots
                else []
            )
        finally:
            self.paused = False
        rows, start = [], 0
        for parents, size in zip(self._inputs, sizes):
            extremes, start = values[start : start + size], start + size
            inputs, outputs = extremes[: 2 * len(parents)], extremes[2 * len(parents) :]
            leaves = [v for i, parent in enumerate(parents) if parent is None for v in inputs[2 * i : 2 * i + 2]]
            rows.append(_Row(_kinds(inputs), _kinds(outputs), _finite_amax(inputs), any(_kinds(leaves))))
        return rows, bad

    def origin(self, roots: Optional[Sequence[Tensor]] = None) -> Optional[Origin]:
        """Where the inf/NaN held by ``roots`` (the loss, or the gradients) was born; ``None`` when every root is
        finite. See the module docstring. Without ``roots``, every operation's output counts: the first operation
        that created a kind of non-finite value its inputs did not hold (non-finite constants written on purpose
        excepted)."""
        rows, bad = self.flags(list(roots or []))
        if roots is None:
            candidates = [i for i in range(len(self._ops)) if rows[i].born and not self._ops[i][3]]
            return self._origin(rows, candidates[0]) if candidates else None
        if not any(bad):
            return None
        starts = [self._producer.get(root) for root, is_bad in zip(roots, bad) if is_bad]
        reached: set[int] = set()
        stack = [i for i in starts if i is not None]
        while stack:
            i = stack.pop()
            if i in reached:
                continue
            reached.add(i)
            stack += [p for p in self._parents[i] if p not in reached and rows[p].out_bad]
        if not reached:  # a root no traced op produced (non-finite data returned as the loss): name what we can
            candidates = [i for i in range(len(self._ops)) if rows[i].out_bad and not self._ops[i][3]]
            return self._origin(rows, candidates[0]) if candidates else None
        order = sorted(reached)
        born = [i for i in order if rows[i].born and not self._ops[i][3]]
        # prefer an op of the roots' own phase: the loss was finite when the roots are gradients, so a forward
        # tensor the backward read (a mask of -inf fed to a fused attention backward) did not start it. Then the
        # first op that read inf/NaN from outside the trace (data, parameters; a mask made before it), then
        # non-finite constants written on purpose
        preferences = (
            [i for i in born if self._ops[i][1] == self.phase],
            born,
            [i for i in order if rows[i].leaf_bad and not self._ops[i][3]],
            [i for i in order if rows[i].born or rows[i].leaf_bad],
            order,
        )
        return self._origin(rows, next(group for group in preferences if group)[0])

    def _origin(self, rows: list[_Row], index: int) -> Origin:
        op, phase, module, _ = self._ops[index]
        module_class = OUTSIDE if module == OUTSIDE else self._classes.get(module, "")
        return Origin(phase, "" if module == OUTSIDE else module, module_class, op, rows[index].input_amax)
