"""What failed in half precision during a forward, found from the error and by running the forward again.

:func:`module_chain` reads an error's traceback (whose frames hold the modules that were running) for the modules and
the outermost module call of the model that failed; :func:`replay` runs that call once more under the same autocast
and op overrides, inside :class:`_EveryFailure`, a ``TorchFunctionMode`` that notes each torch function failing for
the half dtype (the op, the module running it, the line, the value for an overflow) and runs that one op in fp32 so
that the forward goes on to the next failure; :func:`from_traceback` is the one failure an error shows when there is
no module call to run again (``training_step``'s own code). Each is a :class:`HalfFailure`;
:mod:`lightning_mp.diagnostics.half_failure` turns them into one error with the fix.
"""

from __future__ import annotations

import linecache
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from types import FrameType, TracebackType
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves, tree_map

from lightning_mp.forward import override_context
from lightning_mp.policy import CastPolicy

#: Wrappers that hold the user's model and are not part of its names (Lightning's, Fabric's, torch's).
WRAPPERS = (
    "_FabricModule",
    "DistributedDataParallel",
    "FullyShardedDataParallel",
    "_LightningModuleWrapperBase",
    "_LightningPrecisionModuleWrapperBase",
    "OptimizedModule",
)
#: Code that is never the user's: where the failing line is looked for, these frames are passed over.
LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HALF_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class HalfFailure:
    """One op that failed in the half dtype, found by :func:`explain`. ``kind``: ``"no_kernel"`` (the op has no
    kernel for the half dtype on the device), ``"overflow"`` (a constant does not fit the half dtype) or ``"dtype"``
    (another error naming a half dtype). ``module`` is the failing module's qualified name (``""`` for the root
    module or ``training_step``'s code) and ``module_class`` its class; ``rule`` the ``fp32_modules`` rule that runs
    it in fp32 (``""`` when no module rule reaches that code); ``fix`` the one line that fixes every failure of the
    forward (this one included); ``error`` the original error's first line; ``also`` the other modules of the same
    class where the same op failed at the same line (the layers of a stack)."""

    kind: str
    module: str
    module_class: str
    op: str
    where: str
    dtype: str
    device: str
    error: str
    rule: str = ""
    fix: str = ""
    value: Optional[float] = None
    also: tuple[str, ...] = ()

    def place(self) -> str:
        """``"encoder.lstm (LSTM)"``, or ``"the root module (MyModel)"`` for code no module rule reaches."""
        return f"{self.module} ({self.module_class})" if self.module else f"the root module ({self.module_class})"

    def describe(self) -> str:
        """What failed, where, and the original error's first line (no fix)."""
        at = f"op {self.op}" + (f" at {self.where}" if self.where else "")
        place = self.place() + (f" (and {', '.join(self.also)})" if self.also else "")
        if self.kind == "overflow":
            what = (
                f"{place} writes {number(self.value)} into a {self.dtype} tensor ({at}), beyond {self.dtype}'s "
                f"range (largest {number(_largest(self.dtype))})"
            )
        elif self.kind == "no_kernel":
            what = f"{place} cannot run in {self.dtype} on {self.device}: {at} has no {self.dtype} kernel there"
        else:
            what = f"{place} fails in {self.dtype} on {self.device} ({at})"
        return f"{what}: {self.error!r}"

    def message(self) -> str:
        """The one line :class:`HalfPrecisionError` says when this is the forward's only failure."""
        return f"{self.describe()}. Fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "also": list(self.also)}


def kind_of(error: BaseException, dtype: torch.dtype) -> Optional[str]:
    """``"overflow"``, ``"no_kernel"``, ``"dtype"`` or ``None`` (not a half-precision failure), from the message."""
    text = str(error).lower()
    half = "half" in text or "bfloat16" in text or HALF_NAMES.get(dtype, "?") in text
    if "without overflow" in text and half:
        return "overflow"
    if "primitive descriptor" in text or ("not implemented for" in text and half):
        return "no_kernel"
    return "dtype" if half else None


def from_traceback(
    error: BaseException, kind: str, frames: list[Any], chain: list[nn.Module], device: str, dtype: torch.dtype
) -> HalfFailure:
    """The one failure the traceback shows: the innermost module running, the line that raised."""
    module = chain[-1] if chain else None
    name = qualified_name(chain)
    last = frames[-1] if frames else None
    op = linecache.getline(last.f_code.co_filename, last.f_lineno).strip() if last is not None else "?"
    value = None
    if kind == "overflow":  # the constant as written on that line
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?", op)]
        value = next((n for n in numbers if too_large(n, dtype)), None)
    module_class = type(module).__name__ if module is not None else "(outside any module)"
    return HalfFailure(
        kind=kind,
        module=name,
        module_class=module_class,
        op=op,
        where=user_line([(f.f_code.co_filename, f.f_lineno) for f in frames]),
        dtype=HALF_NAMES[dtype],
        device=device,
        error=first_line(error),
        rule=module_class if name else "",
        value=value,
    )


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0].split(". ")[0][:200] if str(error) else type(error).__name__


def frames_of(traceback: Optional[TracebackType]) -> list[Any]:
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    return frames


def user_line(places: list[tuple[str, int]]) -> str:
    """``file.py:line`` of the innermost place (``(filename, line)``, outermost first) outside torch and this
    package: the model's own code."""
    user = [(f, n) for f, n in places if not os.path.abspath(f).startswith(LIBRARY_DIRS)]
    return f"{os.path.basename(user[-1][0])}:{user[-1][1]}" if user else ""


_CALL_IMPL = nn.Module._call_impl.__code__


def module_chain(frames: list[Any]) -> tuple[list[nn.Module], Optional[tuple[nn.Module, Any, Any, Any]]]:
    """The modules running when the error left (outermost first, wrappers dropped, from the innermost
    LightningModule on) and the outermost call of one of them ``(module, forward, args, kwargs)``: the model's
    forward that failed (``None`` when the error came from code outside any module call, ``training_step``)."""
    chain: list[nn.Module] = []
    calls: list[tuple[nn.Module, Any, Any, Any]] = []
    for frame in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and (not chain or chain[-1] is not owner):
            chain.append(owner)
        if frame.f_code is _CALL_IMPL:
            calls.append(
                (owner, frame.f_locals.get("forward_call"), frame.f_locals.get("args", ()),
                 frame.f_locals.get("kwargs", {}))
            )  # fmt: skip
    roots = [i for i, module in enumerate(chain) if _is_lightning_module(module)]
    chain = chain[roots[-1] :] if roots else chain
    while len(chain) > 1 and type(chain[0]).__name__ in WRAPPERS:
        chain = chain[1:]
    if not calls or not chain or calls[-1][0] is not chain[-1]:
        return chain, None  # the innermost module's own code raised outside a module call (training_step)
    running = {id(module) for module in chain}
    outer = next((call for call in calls if id(call[0]) in running and type(call[0]).__name__ not in WRAPPERS), None)
    return chain, outer


def _is_lightning_module(module: nn.Module) -> bool:
    return any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)


def qualified_name(chain: list[nn.Module]) -> str:
    """``encoder.lstm`` for ``[root, encoder, lstm]``: each module's name inside the one that called it."""
    parts = []
    for parent, child in zip(chain, chain[1:]):
        name = next((n for n, m in parent.named_modules() if m is child), None)
        if name is None:
            return ""
        parts.append(name)
    return ".".join(p for p in parts if p)


#: Tensor methods that write their first argument in place without a trailing ``_`` in their name.
_IN_PLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"}


class _EveryFailure(TorchFunctionMode):
    """Runs each torch function (only top-level calls reach a mode: the op itself). One that fails for the half
    dtype is noted with the module running it (a stack kept by global module hooks) and its line, and run again in
    fp32 (floating inputs upcast, autocast off; outputs back in the dtype of its first floating input, an in-place
    op's result written into its target), so that the forward goes on to its next failure."""

    def __init__(self, device: str, dtype: torch.dtype, names: dict[int, str]) -> None:
        super().__init__()
        self.device, self.dtype, self.names = device, dtype, names
        self.running: list[nn.Module] = []  # the module stack, innermost last
        self.found: list[tuple[str, BaseException, str, Optional[nn.Module], str, Optional[float]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as error:
            kind = kind_of(error, self.dtype)
            if kind is None:
                raise
            self._note(func, kind, error, args, kwargs)
            return self._in_fp32(func, args, kwargs)

    def _note(self, func: Any, kind: str, error: BaseException, args: Any, kwargs: Any) -> None:
        module = next((m for m in reversed(self.running) if id(m) in self.names), None)
        places: list[tuple[str, int]] = []
        # the caller of the op (this method and __torch_function__ skipped)
        frame: Optional[FrameType] = sys._getframe(2)
        while frame is not None:
            places.append((frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
        found = [float(v) for v in tree_leaves((args, kwargs)) if too_large(v, self.dtype)]
        op = resolve_name(func) or getattr(func, "__name__", repr(func))
        self.found.append((kind, error, op, module, user_line(places[::-1]), found[0] if found else None))

    def _in_fp32(self, func: Any, args: Any, kwargs: Any) -> Any:
        upcast = tree_map(_to_fp32, (args, kwargs))
        with torch.autocast(self.device, enabled=False):
            out = func(*upcast[0], **upcast[1])
        name = (resolve_name(func) or "").rsplit(".", 1)[-1]
        target = args[0] if args and isinstance(args[0], Tensor) else None
        if target is not None and (name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))):
            target.copy_(upcast[0][0])  # the in-place op wrote the fp32 copy: its target takes the result
            return None if name == "__setitem__" else target
        back = next((t.dtype for t in tree_leaves(args) if isinstance(t, Tensor) and t.is_floating_point()), None)
        if back not in HALF_NAMES:
            return out
        return tree_map(lambda v: v.to(back) if isinstance(v, Tensor) and v.dtype == torch.float32 else v, out)

    # the module hooks' (not push/pop: TorchFunctionMode.push is torch's own classmethod)
    def module_entered(self, module: nn.Module, *args: Any) -> None:
        self.running.append(module)

    def module_left(self, module: nn.Module, *args: Any) -> None:
        if self.running and self.running[-1] is module:
            self.running.pop()


def _to_fp32(value: Any) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def replay(
    call: tuple[nn.Module, Any, Any, Any], root: nn.Module, device: str, dtype: torch.dtype, policy: CastPolicy
) -> tuple[list[HalfFailure], str]:
    """Run the model's failing forward once more, under the same autocast and op overrides, through every failure
    (:class:`_EveryFailure`); the failures, grouped (the same op on the same line in modules of one class: one
    entry with the others in ``also``), and why the replay stopped early (``""`` when it reached the end)."""
    module, forward, args, kwargs = call
    names = {id(m): name for name, m in root.named_modules()}
    recorder = _EveryFailure(device, dtype, names)
    recorder.running.append(module)  # its forward is called directly (no hooks): its own code is its own
    pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.module_entered)
    post = torch.nn.modules.module.register_module_forward_hook(recorder.module_left, always_call=True)
    stopped = ""
    try:
        autocast = torch.autocast(device, dtype=dtype, cache_enabled=False)
        with (
            autocast,
            override_context(policy, device, dtype),
            recorder,
        ):  # the recorder innermost: it sees each op first
            (forward or module.forward)(*args, **kwargs)
    except Exception as error:  # a failure the recorder could not run past: reported with those found before it
        stopped = f"{type(error).__name__}: {first_line(error).rstrip('.')}"
    finally:
        pre.remove()
        post.remove()
    grouped: dict[tuple[str, str, str, str], HalfFailure] = {}
    for kind, raised, op, owner, where, value in recorder.found:
        name = names.get(id(owner), "") if owner is not None else ""
        module_class = type(owner).__name__ if owner is not None else type(root).__name__
        key = (kind, op, where, module_class)
        if key in grouped:
            known = grouped[key]
            if name != known.module and name not in known.also:
                grouped[key] = replace(known, also=(*known.also, name))
            continue
        grouped[key] = HalfFailure(
            kind=kind,
            module=name,
            module_class=module_class,
            op=op,
            where=where,
            dtype=HALF_NAMES[dtype],
            device=device,
            error=first_line(raised),
            rule=module_class if name else "",
            value=value,
        )
    return list(grouped.values()), stopped


def too_large(value: Any, dtype: torch.dtype) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > torch.finfo(dtype).max


def _largest(dtype_name: str) -> float:
    return torch.finfo(getattr(torch, dtype_name)).max


def number(value: Optional[float]) -> str:
    if value is None:
        return "a constant"
    return f"{value:g}" if math.isfinite(value) else str(value)
