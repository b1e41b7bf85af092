"""``audit``: which aten ops actually ran, in which dtype, inside which module, and how many matmul FLOPs.

A cast policy says what *should* happen; ``audit`` records what *did* happen, one training step at a time::

    census = audit(model, batch, context=torch.autocast("cpu", dtype=torch.bfloat16))
    print(census)                                  # table + "matmul FLOPs in half precision: 99.2%" + risky ops
    assert census.dtypes_of("addmm", phase="forward") == {"bfloat16"}

Every aten op call is seen by a ``TorchDispatchMode`` (below autograd and autocast, so casts and the real kernels
show up). Forward ops are attributed to the innermost running submodule through forward pre/post hooks; backward ops
to the submodule whose forward created the autograd node being run (a ``TorchFunctionMode`` tags the nodes), or
``"<backward>"`` before the first tagged node. All hooks and modes are removed when ``audit`` returns or raises.

The pieces: :mod:`~lightning_mp.diagnostics.census` (what is returned), :mod:`~lightning_mp.diagnostics.aten_ops`
(FLOPs, compute dtype and risk of one aten call), this module (the recording).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Protocol, cast

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_mp.diagnostics.aten_ops import IGNORED_OPS, compute_dtype, matmul_flops, risk
from lightning_mp.diagnostics.census import Census, Finding, Row
from lightning_mp.standalone import lightning_isinstance


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
            dtype, module = compute_dtype(op, args, kwargs, out), self.current_module()
            row = self.rows.setdefault((op, dtype, self.phase, module), Row(op, dtype, self.phase, module))
            row.count += 1
            row.flops += matmul_flops(func, args, kwargs, out)
            why = risk(op, dtype, args, out, self.large_reduction)
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
    if not lightning_isinstance(module, pl.LightningModule) or attached:
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
    if lightning_isinstance(module, pl.LightningModule):
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
            is a dict, or ``result.float().sum()`` if it is a non-scalar tensor. The ``.grad`` of ``module``'s
            parameters are left as they were (``None`` stays ``None``, an existing gradient keeps its value); a
            leaf tensor of your own that requires grad (an input) receives its gradient as ``backward`` leaves it.
        large_reduction: a sum/mean/norm reducing at least this many elements per output value in float16/bfloat16
            is flagged risky (default 65536 elements).

    Returns:
        a :class:`Census`. Hooks, modes and the ``log`` patch are removed also when the forward or backward raises.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(large_reduction, bool) or not isinstance(large_reduction, int) or large_reduction < 1:
        raise ValueError(f"large_reduction must be a positive int (elements), got {large_reduction!r}")
    wrapper, module = _fabric_unwrapped(module)  # a Fabric-wrapped module: named as the user's, run through Fabric
    recorder = _Recorder(large_reduction)
    tagger = _NodeTagger(recorder)
    handles = _module_hooks(module, recorder)
    grads = [(p, p.grad, None if p.grad is None else p.grad.clone()) for p in module.parameters()] if backward else []
    try:
        with _silenced_log(module), tagger, recorder:
            with _entered(context):
                if callable(batch_or_callable):
                    result = batch_or_callable()
                else:
                    result = _forward(wrapper, batch_or_callable)
            if backward:
                loss = _as_loss(result)
                recorder.phase = "backward"
                with _fabric_backward():
                    loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        tagger.remove_hooks()
        with torch.no_grad():
            for param, grad, value in grads:  # the audit's backward leaves no trace in the parameters' gradients
                if grad is not None and value is not None:  # (a clone of each gradient there is)
                    grad.copy_(value)
                if param.grad is not grad:  # not assigned again where it is: a gradient fp32 masters show is fp32
                    param.grad = grad
    return recorder.census()


def _fabric_unwrapped(module: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(what runs the forward, what is named and hooked)``: for a module that ``fabric.setup`` wrapped, the wrapper
    (Fabric's forward context and output conversion) and the user's module inside; otherwise ``module`` twice."""
    from lightning.fabric.wrappers import _FabricModule

    if lightning_isinstance(module, _FabricModule):  # lightning's or lightning_fabric's
        return module, module._forward_module
    return module, module


class _FabricWrappers(Protocol):
    """What the audit sets in a loaded copy of Fabric's ``wrappers`` module (a module found in ``sys.modules``)."""

    _in_fabric_backward: bool


@contextlib.contextmanager
def _fabric_backward() -> Iterator[None]:
    """Fabric refuses ``loss.backward()`` on a wrapped module's output outside ``fabric.backward``; the audit's own
    backward (which steps nothing and leaves the gradients as they were) is let through, by each loaded copy of
    Fabric's wrappers (``lightning.fabric``'s, the standalone ``lightning_fabric``'s)."""
    loaded = [cast(_FabricWrappers, sys.modules[name]) for name in _FABRIC_WRAPPERS if name in sys.modules]
    before = [wrappers._in_fabric_backward for wrappers in loaded]
    for wrappers in loaded:
        wrappers._in_fabric_backward = True
    try:
        yield
    finally:
        for wrappers, value in zip(loaded, before):
            wrappers._in_fabric_backward = value


_FABRIC_WRAPPERS = ("lightning.fabric.wrappers", "lightning_fabric.wrappers")
