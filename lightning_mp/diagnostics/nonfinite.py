"""Find the first operation whose output became non-finite during one forward and backward, and its module.

:class:`NonFiniteTrace` is a context manager that, while active, checks every aten operation (views excepted):
whether any floating output holds inf/NaN, whether any floating input already did, and the largest finite
magnitude among its inputs. The checks stay on the device; :meth:`NonFiniteTrace.origin` reads them all with one
host sync and returns the first operation whose output is non-finite although its inputs were finite: the place
where the inf/NaN was born. An operation that writes a non-finite constant on purpose (``masked_fill(mask, -inf)``
for attention masks) is not an origin; its -inf values die in the softmax that follows.

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
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


class _Checks(TorchDispatchMode):
    def __init__(self, trace: NonFiniteTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func.overloadpacket.__name__
        if op in IGNORED_OPS or op in UNINITIALISED_OPS or self.trace.paused:
            return func(*args, **kwargs)
        inputs = _floats((args, kwargs))
        # inputs are checked before the op runs: an in-place op overwrites them
        in_checks = [(~torch.isfinite(t).all(), torch.where(torch.isfinite(t), t.abs(), 0).amax()) for t in inputs]
        out = func(*args, **kwargs)
        outputs = _floats(out)
        if outputs:
            self.trace._record(op, in_checks, outputs, _nonfinite_constant(args, kwargs))
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
        self._flags: list[Tensor] = []  # per op: [output non-finite, some input non-finite, largest finite input]
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

    def _record(self, op: str, in_checks: list[tuple[Tensor, Tensor]], outputs: list[Tensor], constant: bool) -> None:
        out_bad = torch.stack([(~torch.isfinite(t).all()).to(self.device) for t in outputs]).any()
        if in_checks:
            in_bad = torch.stack([bad.to(self.device) for bad, _ in in_checks]).any()
            in_amax = torch.stack([amax.float().to(self.device) for _, amax in in_checks]).amax()
        else:
            in_bad, in_amax = torch.zeros((), dtype=torch.bool, device=self.device), torch.zeros((), device=self.device)
        self._flags.append(torch.stack([out_bad.float(), in_bad.float(), in_amax]))
        self._ops.append((op, self.phase, self.current_module(), constant))

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
    def flags(self) -> list[list[float]]:
        """Per operation ``[output non-finite, input non-finite, largest finite input]``: one host sync."""
        if not self._flags:
            return []
        self.paused = True
        try:
            return torch.stack(self._flags).tolist()
        finally:
            self.paused = False

    def origin(self, flags: Optional[list[list[float]]] = None) -> Optional[Origin]:
        """The first operation whose output holds inf/NaN while its inputs were finite (a non-finite constant
        written on purpose does not count); failing that, the first non-finite output not written on purpose;
        ``None`` when every output was finite."""
        flags = self.flags() if flags is None else flags
        candidates = [i for i, (op, _, _, constant) in enumerate(self._ops) if flags[i][0] and not constant]
        born = [i for i in candidates if not flags[i][1]]
        chosen = (born or candidates or [None])[0]
        if chosen is None:
            return None
        op, phase, module, _ = self._ops[chosen]
        module_class = OUTSIDE if module == OUTSIDE else self._classes.get(module, "")
        return Origin(phase, "" if module == OUTSIDE else module, module_class, op, float(flags[chosen][2]))

    def any_nonfinite(self, flags: Optional[list[list[float]]] = None) -> bool:
        """Whether any operation (other than one writing a non-finite constant) produced inf/NaN."""
        flags = self.flags() if flags is None else flags
        return any(flags[i][0] and not self._ops[i][3] for i in range(len(self._ops)))
