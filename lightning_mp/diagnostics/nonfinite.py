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
``inf - inf`` making NaN; ``softmax`` of a row that is ``-inf`` everywhere making NaN). An operation that writes a
non-finite constant on purpose (``masked_fill(mask, -inf)``) is chosen only when nothing else explains the roots.
Non-finite values that never reach a root are by design and are never an origin.

Each operation is credited to a module: in forward, the innermost module running (forward pre/post hooks); in
backward, the module whose forward created the autograd node being run (``torch._C._current_autograd_node()``,
mapped to modules by a ``TorchFunctionMode`` during forward), which also credits code in a tensor hook registered on
a module's output to that module. Everything is removed when the context exits. Only used to replay a skipped step:
it costs a few extra kernels per operation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_mp.diagnostics.aten_ops import IGNORED_OPS

OUTSIDE = "(outside any module)"
#: ops that return uninitialised memory (whatever bits were there, NaN included): never checked
UNINITIALISED_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                               "empty_permuted"})


@dataclass(frozen=True)
class Origin:
    """Where a non-finite value was first produced. ``input_amax`` is the largest finite magnitude among the
    operation's floating inputs (``0.0`` when it had none)."""

    phase: str
    module: str
    module_class: str
    op: str
    input_amax: float


def _floats(value: Any) -> list[Tensor]:
    return [
        t for t in tree_leaves(value)
        if isinstance(t, Tensor) and t.is_floating_point() and not t.is_sparse and t.numel() > 0
    ]


def _nonfinite_constant(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(v, float) and not math.isfinite(v) for v in tree_leaves((args, kwargs)))


def _kinds(tensor: Tensor) -> Tensor:
    """``[holds NaN, holds +inf, holds -inf, largest finite magnitude]`` (float32, on the tensor's device)."""
    tensor = tensor.detach()
    finite = torch.isfinite(tensor)
    return torch.stack([
        torch.isnan(tensor).any().float(), (tensor == math.inf).any().float(), (tensor == -math.inf).any().float(),
        torch.where(finite, tensor.abs(), 0).amax().float(),
    ])


#: columns of one operation's flags
_IN, _IN_AMAX, _OUT, _LEAF_BAD = slice(0, 3), 3, slice(4, 7), 7


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
        in_checks = [_kinds(t) for t in inputs]
        parents = [trace._producer.get(t) for t in inputs]
        out = func(*args, **kwargs)
        outputs = _floats(out)
        if outputs:
            trace._record(op, in_checks, parents, outputs, _nonfinite_constant(args, kwargs))
        return out


class _NodeModules(TorchFunctionMode):
    """During forward: remembers which module created each autograd node."""

    def __init__(self, trace: NonFiniteTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.trace.phase == "forward" and torch.is_grad_enabled():
            for t in tree_leaves(out):
                node = t.grad_fn if isinstance(t, Tensor) else None
                if node is not None and node not in self.trace.node_modules:  # innermost module wins
                    self.trace.node_modules[node] = self.trace.current_module()
        return out


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
        # per op: [inputs hold NaN, +inf, -inf, largest finite input, output holds NaN, +inf, -inf, a non-finite
        # input that no traced op produced (data, parameters)]
        self._flags: list[Tensor] = []
        self._parents: list[list[int]] = []  # per op: the traced ops that produced its floating inputs
        self._producer: WeakTensorKeyDictionary = WeakTensorKeyDictionary()  # live tensor -> op that produced it
        self._classes = {name: type(module).__name__ for name, module in model.named_modules()}
        self._handles: list[Any] = []
        self._modes: list[Any] = []
        self.paused = False  # while reading the flags: those ops are ours, not the model's

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

    def _record(self, op: str, in_checks: list[Tensor], parents: list[Optional[int]], outputs: list[Tensor],
                constant: bool) -> None:
        out_kinds = torch.stack([_kinds(t).to(self.device) for t in outputs]).amax(0)[:3]
        if in_checks:
            ins = torch.stack([check.to(self.device) for check in in_checks])
            unproduced = [i for i, parent in enumerate(parents) if parent is None]
            leaf_bad = ins[unproduced, :3].amax() if unproduced else torch.zeros((), device=self.device)
            row = torch.cat([ins.amax(0), out_kinds, leaf_bad.reshape(1)])
        else:
            row = torch.cat([torch.zeros(4, device=self.device), out_kinds, torch.zeros(1, device=self.device)])
        index = len(self._ops)
        self._flags.append(row)
        self._parents.append(sorted({parent for parent in parents if parent is not None}))
        self._ops.append((op, self.phase, self.current_module(), constant))
        for tensor in outputs:
            self._producer[tensor] = index

    def _alias(self, args: Any, out: Any) -> None:
        base = next((t for t in tree_leaves(args) if isinstance(t, Tensor)), None)
        parent = self._producer.get(base) if base is not None else None
        if parent is None:
            return
        for tensor in tree_leaves(out):
            if isinstance(tensor, Tensor):
                self._producer[tensor] = parent

    # ------------------------------------------------------------------ context
    def __enter__(self) -> NonFiniteTrace:
        for name, module in self.model.named_modules():
            self._handles.append(module.register_forward_pre_hook(partial(self._push, name)))
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
    def flags(self, roots: Sequence[Tensor] = ()) -> tuple[list[list[float]], list[bool]]:
        """Per operation its flags (see ``_flags``), and per root whether it holds inf/NaN: one host sync."""
        if not self._flags and not roots:
            return [], []
        self.paused = True
        try:
            rows = torch.stack(self._flags).tolist() if self._flags else []
            bad = torch.stack([(~torch.isfinite(r.detach()).all()).to(self.device) for r in roots]).tolist() \
                if roots else []
            return rows, bad
        finally:
            self.paused = False

    def origin(self, roots: Optional[Sequence[Tensor]] = None) -> Optional[Origin]:
        """Where the inf/NaN held by ``roots`` (the loss, or the gradients) was born; ``None`` when every root is
        finite. See the module docstring. Without ``roots``, every operation's output counts: the first operation
        that created a kind of non-finite value its inputs did not hold (non-finite constants written on purpose
        excepted)."""
        rows, bad = self.flags(list(roots or []))
        if roots is None:
            candidates = [i for i in range(len(self._ops)) if self._born(rows[i]) and not self._ops[i][3]]
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
            stack += [p for p in self._parents[i] if p not in reached and any(rows[p][_OUT])]
        if not reached:  # a root no traced op produced (non-finite data returned as the loss): name what we can
            candidates = [i for i in range(len(self._ops)) if any(rows[i][_OUT]) and not self._ops[i][3]]
            return self._origin(rows, candidates[0]) if candidates else None
        order = sorted(reached)
        born = [i for i in order if self._born(rows[i]) or rows[i][_LEAF_BAD]]
        chosen = next((i for i in born if not self._ops[i][3]), None)
        chosen = chosen if chosen is not None else (born or order)[0]
        return self._origin(rows, chosen)

    @staticmethod
    def _born(row: list[float]) -> bool:
        """The output holds a kind of non-finite value (NaN, +inf, -inf) that no input held."""
        return any(out and not held for out, held in zip(row[_OUT], row[_IN]))

    def _origin(self, rows: list[list[float]], index: int) -> Origin:
        op, phase, module, _ = self._ops[index]
        module_class = OUTSIDE if module == OUTSIDE else self._classes.get(module, "")
        return Origin(phase, "" if module == OUTSIDE else module, module_class, op, float(rows[index][_IN_AMAX]))
