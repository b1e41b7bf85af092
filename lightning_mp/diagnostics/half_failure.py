"""Half-precision failures that are not overflows of the gradients: an op with no fp16/bf16 kernel on the device
(``nn.LSTM`` under fp16 autocast on a CPU: ``could not create a primitive descriptor for the LSTM forward
propagation primitive``), a constant too large for the half tensor it is written into (``x.masked_fill(mask, -1e9)``
on fp16: ``value cannot be converted to type c10::Half without overflow``), or another error that names a half
dtype. Such an error ends the run at the first forward, far from its cause, and a model often has more than one.

:class:`ExplainingAutocast` is the plugin's ``torch.autocast``: on the normal path it is that context and nothing
more (no hook, no mode, no per-op Python). When an error leaves the forward it reads the traceback (whose frames
hold the modules that were running) and runs the outermost module call of the model that failed (the model's
``forward``, with every submodule) once more under :class:`_EveryFailure`, a ``TorchFunctionMode`` that notes each
torch function failing for the half dtype (the op, the module running it, the line, the value for an overflow) and
runs that one op in fp32 so that the forward goes on to the next failure. It then raises one
:class:`HalfPrecisionError` naming every failure of that forward and the one cast-policy line that fixes them all,
``from None`` (the original error, with its traceback through torch's internals, is kept as ``.original``). An
error it cannot explain is left as it was.
"""

from __future__ import annotations

import linecache
import math
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from types import TracebackType
from typing import Any, Optional, Union

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
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HALF_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


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
                f"{place} writes {_number(self.value)} into a {self.dtype} tensor ({at}), beyond {self.dtype}'s "
                f"range (largest {_number(_largest(self.dtype))})"
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


class HalfPrecisionError(RuntimeError):
    """Every op of one forward that cannot run in the half dtype, explained: :attr:`failures` (one
    :class:`HalfFailure` each, in the order the forward met them; :attr:`failure` the first), :attr:`fix` (the one
    line that fixes them all), :attr:`rules` (the ``fp32_modules`` rules it adds) and :attr:`original` (the error the
    forward raised; ``None`` once pickled). Raised ``from None``: the original's traceback through torch's
    internals is not printed, it stays in :attr:`original`. ``stopped``: why the diagnosis ended before the end of
    the forward (``""`` when it reached the end)."""

    def __init__(
        self,
        failures: Union[HalfFailure, Sequence[HalfFailure]],
        original: Optional[BaseException] = None,
        stopped: str = "",
    ) -> None:
        self.failures: tuple[HalfFailure, ...] = (failures,) if isinstance(failures, HalfFailure) else tuple(failures)
        self.failure = self.failures[0]
        self.fix = self.failure.fix
        self.rules = [f.rule for f in self.failures if f.rule]
        self.original = original
        self.stopped = stopped
        super().__init__(_error_message(self.failures, stopped))

    def __reduce__(self) -> Any:  # pickled whole (a spawned rank's error reaches the parent process)
        return type(self), (self.failures, None, self.stopped)


def _error_message(failures: tuple[HalfFailure, ...], stopped: str) -> str:
    first = failures[0]
    note = (
        f" (The diagnosis stopped early, at {stopped}: later ops of the forward were not checked.)" if stopped else ""
    )
    if len(failures) == 1:
        return first.message() + note
    listed = "\n".join(f"  {i}. {failure.describe()}" for i, failure in enumerate(failures, 1))
    return (
        f"{len(failures)} ops of this forward cannot run in {first.dtype} on {first.device}:\n{listed}\n"
        f"Fix them all: {first.fix}{note}"
    )


class ExplainingAutocast(torch.autocast):
    """``torch.autocast`` that turns a half-precision failure leaving the forward into one :class:`HalfPrecisionError`
    naming every failure of that forward (see the module docstring). ``policy`` is the cast policy in effect, so the
    fix adds to it."""

    def __init__(self, device_type: str, dtype: torch.dtype, policy: CastPolicy, cache_enabled: bool = False) -> None:
        super().__init__(device_type, dtype=dtype, cache_enabled=cache_enabled)
        self.policy = policy

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Optional[TracebackType]) -> Any:
        result = super().__exit__(exc_type, exc_val, exc_tb)
        if isinstance(exc_val, RuntimeError) and not isinstance(exc_val, HalfPrecisionError):
            explained = explain(exc_val, self.device, self.fast_dtype, self.policy)
            if explained is not None:
                raise explained from None  # the original (torch's internals) stays in .original, not printed
        return result


def kind_of(error: BaseException, dtype: torch.dtype) -> Optional[str]:
    """``"overflow"``, ``"no_kernel"``, ``"dtype"`` or ``None`` (not a half-precision failure), from the message."""
    text = str(error).lower()
    half = "half" in text or "bfloat16" in text or _HALF_NAMES.get(dtype, "?") in text
    if "without overflow" in text and half:
        return "overflow"
    if "primitive descriptor" in text or ("not implemented for" in text and half):
        return "no_kernel"
    return "dtype" if half else None


def explain(error: BaseException, device: str, dtype: torch.dtype, policy: CastPolicy) -> Optional[HalfPrecisionError]:
    """The :class:`HalfPrecisionError` behind ``error`` raised inside a ``dtype`` autocast on ``device`` (every
    failure of the forward it left), or ``None`` when it is not a half-precision failure. Runs only on the failure
    path; never raises."""
    kind = kind_of(error, dtype)
    if kind is None or dtype not in _HALF_NAMES:
        return None
    try:
        return _explain(error, kind, device, dtype, policy)
    except Exception:  # an explanation that fails leaves the original error as it was (raised by the caller)
        return None


def _explain(
    error: BaseException, kind: str, device: str, dtype: torch.dtype, policy: CastPolicy
) -> HalfPrecisionError:
    frames = _frames(error.__traceback__)
    chain, outer = _module_chain(frames)
    failures: list[HalfFailure] = []
    stopped = ""
    if outer is not None:  # the model's forward that failed, once more: every failure it meets
        failures, stopped = _replay(outer, chain[0], device, dtype, policy)
    if not failures:  # training_step's own code (no module call to run again), or the forward did not fail again
        failures = [_from_traceback(error, kind, frames, chain, device, dtype)]
        stopped = ""
    fix = fix_for_all(failures, policy)
    return HalfPrecisionError([replace(failure, fix=fix) for failure in failures], original=error, stopped=stopped)


def _from_traceback(
    error: BaseException, kind: str, frames: list[Any], chain: list[nn.Module], device: str, dtype: torch.dtype
) -> HalfFailure:
    """The one failure the traceback shows: the innermost module running, the line that raised."""
    module = chain[-1] if chain else None
    name = _qualified_name(chain)
    last = frames[-1] if frames else None
    op = linecache.getline(last.f_code.co_filename, last.f_lineno).strip() if last is not None else "?"
    value = None
    if kind == "overflow":  # the constant as written on that line
        numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?", op)]
        value = next((n for n in numbers if _too_large(n, dtype)), None)
    module_class = type(module).__name__ if module is not None else "(outside any module)"
    return HalfFailure(
        kind=kind,
        module=name,
        module_class=module_class,
        op=op,
        where=_user_line([(f.f_code.co_filename, f.f_lineno) for f in frames]),
        dtype=_HALF_NAMES[dtype],
        device=device,
        error=_first_line(error),
        rule=module_class if name else "",
        value=value,
    )


def fix_for(failure: HalfFailure, policy: CastPolicy) -> str:
    """The cast-policy line that runs the failing module in fp32 (with the rules already in ``policy``), or, for
    code no module rule reaches, what to change there."""
    return fix_for_all([failure], policy)


def fix_for_all(failures: Sequence[HalfFailure], policy: CastPolicy) -> str:
    """One line that fixes every failure: one ``fp32_modules`` policy (the rules already in ``policy`` plus one per
    failing module class) for the failures inside submodules, and what to change for code no module rule reaches."""
    ruled = [f for f in failures if f.rule]
    parts = []
    if ruled:
        rules = list(dict.fromkeys([*policy.fp32_modules, *(f.rule for f in ruled)]))
        fields = _fields(policy, rules)
        python = "{" + ", ".join(f"{key!r}: {value!r}" for key, value in fields.items()) + "}"
        yaml = "{" + ", ".join(f"{key}: {_yaml(value)}" for key, value in fields.items()) + "}"
        them = "it" if len({f.rule for f in ruled}) == 1 else "them"
        line = f"keep {them} in fp32 with MixedPrecisionPlugin(policy={python}) (YAML: policy: {yaml})"
        constants = [
            f"{_finfo(f)} in " + ("its forward" if them == "it" else f"{f.module_class}'s forward")
            for f in _unique(ruled, lambda f: (f.module_class, f.value))
            if f.kind == "overflow"
        ]
        parts.append(line.replace("'", '"') + (", or write " + "; ".join(constants) if constants else ""))
    for failure in _unique([f for f in failures if not f.rule], lambda f: f.where):
        where = "there" if not failure.where else f"at {failure.where}"
        parts.append(
            "no fp32_modules rule reaches this code (it is not inside a submodule): "
            + (
                f"write {_finfo(failure)} {where}"
                if failure.kind == "overflow"
                else f"compute it in float32 {where} (cast its inputs with .float())"
            )  # fmt: skip
            + ", or move it into a submodule and keep that in fp32 with policy={'fp32_modules': [...]}"
        )
    return "; and ".join(parts) + "."


def _finfo(failure: HalfFailure) -> str:
    return f"torch.finfo(x.dtype).min instead of {_number(failure.value)}"


def _unique(failures: Sequence[HalfFailure], key: Any) -> list[HalfFailure]:
    seen: dict[Any, HalfFailure] = {}
    for failure in failures:
        seen.setdefault(key(failure), failure)
    return list(seen.values())


def _fields(policy: CastPolicy, rules: list[str]) -> dict[str, Any]:
    # the policy's fields that differ from the default, with fp32_modules extended: the whole policy in one line
    default = CastPolicy()
    fields = {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in asdict(policy).items()
        if value != getattr(default, key) and key != "fp32_modules"
    }
    return {**fields, "fp32_modules": rules}


def _yaml(value: Any) -> str:
    return "[" + ", ".join(str(item) for item in value) + "]" if isinstance(value, list) else str(value)


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0].split(". ")[0][:200] if str(error) else type(error).__name__


def _frames(traceback: Optional[TracebackType]) -> list[Any]:
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    return frames


def _user_line(places: list[tuple[str, int]]) -> str:
    """``file.py:line`` of the innermost place (``(filename, line)``, outermost first) outside torch and this
    package: the model's own code."""
    user = [(f, n) for f, n in places if not os.path.abspath(f).startswith(_LIBRARY_DIRS)]
    return f"{os.path.basename(user[-1][0])}:{user[-1][1]}" if user else ""


_CALL_IMPL = nn.Module._call_impl.__code__


def _module_chain(frames: list[Any]) -> tuple[list[nn.Module], Optional[tuple[nn.Module, Any, Any, Any]]]:
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


def _qualified_name(chain: list[nn.Module]) -> str:
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
        self.found: list[tuple[str, BaseException, str, nn.Module, str, Optional[float]]] = []

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
        places, frame = [], sys._getframe(2)  # the caller of the op (this method and __torch_function__ skipped)
        while frame is not None:
            places.append((frame.f_code.co_filename, frame.f_lineno))
            frame = frame.f_back
        found = [float(v) for v in tree_leaves((args, kwargs)) if _too_large(v, self.dtype)]
        op = resolve_name(func) or getattr(func, "__name__", repr(func))
        self.found.append((kind, error, op, module, _user_line(places[::-1]), found[0] if found else None))

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
        if back not in _HALF_NAMES:
            return out
        return tree_map(lambda v: v.to(back) if isinstance(v, Tensor) and v.dtype == torch.float32 else v, out)

    def push(self, module: nn.Module, *args: Any) -> None:
        self.running.append(module)

    def pop(self, module: nn.Module, *args: Any) -> None:
        if self.running and self.running[-1] is module:
            self.running.pop()


def _to_fp32(value: Any) -> Any:
    if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != torch.float32:
        return value.float()
    return value


def _replay(
    call: tuple[nn.Module, Any, Any, Any], root: nn.Module, device: str, dtype: torch.dtype, policy: CastPolicy
) -> tuple[list[HalfFailure], str]:
    """Run the model's failing forward once more, under the same autocast and op overrides, through every failure
    (:class:`_EveryFailure`); the failures, grouped (the same op on the same line in modules of one class: one
    entry with the others in ``also``), and why the replay stopped early (``""`` when it reached the end)."""
    module, forward, args, kwargs = call
    names = {id(m): name for name, m in root.named_modules()}
    recorder = _EveryFailure(device, dtype, names)
    pre = torch.nn.modules.module.register_module_forward_pre_hook(recorder.push)
    post = torch.nn.modules.module.register_module_forward_hook(recorder.pop, always_call=True)
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
        stopped = f"{type(error).__name__}: {_first_line(error).rstrip('.')}"
    finally:
        pre.remove()
        post.remove()
    grouped: dict[tuple[str, str, str, str], HalfFailure] = {}
    for kind, error, op, owner, where, value in recorder.found:
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
            dtype=_HALF_NAMES[dtype],
            device=device,
            error=_first_line(error),
            rule=module_class if name else "",
            value=value,
        )
    return list(grouped.values()), stopped


def _too_large(value: Any, dtype: torch.dtype) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > torch.finfo(dtype).max


def _largest(dtype_name: str) -> float:
    return torch.finfo(getattr(torch, dtype_name)).max


def _number(value: Optional[float]) -> str:
    if value is None:
        return "a constant"
    return f"{value:g}" if math.isfinite(value) else str(value)
