"""Half-precision failures that are not overflows of the gradients: an op with no fp16/bf16 kernel on the device
(``nn.LSTM`` under fp16 autocast on a CPU: ``could not create a primitive descriptor for the LSTM forward
propagation primitive``), a constant too large for the half tensor it is written into (``x.masked_fill(mask, -1e9)``
on fp16: ``value cannot be converted to type c10::Half without overflow``), or another error that names a half
dtype. Such an error ends the run at the first forward, far from its cause.

:class:`ExplainingAutocast` is the plugin's ``torch.autocast``: on the normal path it is that context and nothing
more (no hook, no mode, no per-op Python). When an error leaves the forward it reads the traceback (whose frames
hold the modules that were running), re-runs the innermost module once under a ``TorchFunctionMode`` that notes
the first torch function that raises (the op and its arguments), and raises :class:`HalfPrecisionError` from the
original error: the module's qualified name and class, the op, the value (for an overflow) and the cast-policy
line that fixes it. An error it cannot explain is left as it was.
"""

from __future__ import annotations

import linecache
import math
import os
import re
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_map

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
    """What :func:`explain` found. ``kind``: ``"no_kernel"`` (the op has no kernel for the half dtype on the device),
    ``"overflow"`` (a constant does not fit the half dtype) or ``"dtype"`` (another error naming a half dtype).
    ``module`` is the failing module's qualified name (``""`` for the root module or ``training_step``'s code) and
    ``module_class`` its class; ``rule`` the ``fp32_modules`` rule that runs it in fp32 (``""`` when no module rule
    reaches that code); ``fix`` the one line to apply; ``error`` the original error's first line."""

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

    def place(self) -> str:
        """``"encoder.lstm (LSTM)"``, or ``"the root module (MyModel)"`` for code no module rule reaches."""
        return f"{self.module} ({self.module_class})" if self.module else f"the root module ({self.module_class})"

    def message(self) -> str:
        """The one line :class:`HalfPrecisionError` says."""
        at = f"op {self.op}" + (f" at {self.where}" if self.where else "")
        if self.kind == "overflow":
            what = (
                f"{self.place()} writes {_number(self.value)} into a {self.dtype} tensor ({at}), beyond {self.dtype}'s "
                f"range (largest {_number(_largest(self.dtype))})"
            )
        elif self.kind == "no_kernel":
            what = f"{self.place()} cannot run in {self.dtype} on {self.device}: {at} has no {self.dtype} kernel there"
        else:
            what = f"{self.place()} fails in {self.dtype} on {self.device} ({at})"
        return f"{what}: {self.error!r}. Fix: {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class HalfPrecisionError(RuntimeError):
    """An op that cannot run in the half dtype, explained (:class:`HalfFailure` in ``.failure``); raised from the
    original error, which stays in ``__cause__``."""

    def __init__(self, failure: HalfFailure) -> None:
        super().__init__(failure.message())
        self.failure = failure

    def __reduce__(self) -> Any:  # pickled whole (a spawned rank's error reaches the parent process)
        return type(self), (self.failure,)


class ExplainingAutocast(torch.autocast):
    """``torch.autocast`` that turns a half-precision failure leaving the forward into :class:`HalfPrecisionError`
    (see the module docstring). ``policy`` is the cast policy in effect, so the fix adds to it."""

    def __init__(self, device_type: str, dtype: torch.dtype, policy: CastPolicy, cache_enabled: bool = False) -> None:
        super().__init__(device_type, dtype=dtype, cache_enabled=cache_enabled)
        self.policy = policy

    def __exit__(self, exc_type: Any, exc_val: Any, exc_tb: Optional[TracebackType]) -> Any:
        result = super().__exit__(exc_type, exc_val, exc_tb)
        if isinstance(exc_val, RuntimeError) and not isinstance(exc_val, HalfPrecisionError):
            failure = explain(exc_val, self.device, self.fast_dtype, self.policy)
            if failure is not None:
                raise HalfPrecisionError(failure) from exc_val
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


def explain(error: BaseException, device: str, dtype: torch.dtype, policy: CastPolicy) -> Optional[HalfFailure]:
    """The :class:`HalfFailure` behind ``error`` raised inside a ``dtype`` autocast on ``device``, or ``None``
    when it is not a half-precision failure. Runs only on the failure path; never raises."""
    kind = kind_of(error, dtype)
    if kind is None or dtype not in _HALF_NAMES:
        return None
    try:
        return _explain(error, kind, device, dtype, policy)
    except Exception:  # an explanation that fails leaves the original error as it was (raised by the caller)
        return None


def _explain(error: BaseException, kind: str, device: str, dtype: torch.dtype, policy: CastPolicy) -> HalfFailure:
    frames = _frames(error.__traceback__)
    chain, call = _module_chain(frames)
    module = chain[-1] if chain else None
    name = _qualified_name(chain)
    op, value = _replay(call, device, dtype) if call is not None else (None, None)
    user = [f for f in frames if not os.path.abspath(f.f_code.co_filename).startswith(_LIBRARY_DIRS)]
    where = f"{os.path.basename(user[-1].f_code.co_filename)}:{user[-1].f_lineno}" if user else ""
    if op is None:  # no replay (training_step's own code) or it did not fail again: the line that raised
        last = frames[-1] if frames else None
        op = linecache.getline(last.f_code.co_filename, last.f_lineno).strip() if last is not None else "?"
        if kind == "overflow":  # the constant as written on that line
            numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d*)?(?:[eE][-+]?\d+)?", op)]
            value = next((n for n in numbers if _too_large(n, dtype)), None)
    module_class = type(module).__name__ if module is not None else "(outside any module)"
    rule = module_class if name else ""
    failure = HalfFailure(
        kind=kind,
        module=name,
        module_class=module_class,
        op=op,
        where=where,
        dtype=_HALF_NAMES[dtype],
        device=device,
        error=str(error).splitlines()[0].split(". ")[0][:200],
        rule=rule,
        value=value,
    )
    return HalfFailure(**{**failure.to_dict(), "fix": fix_for(failure, policy)})


def fix_for(failure: HalfFailure, policy: CastPolicy) -> str:
    """The cast-policy line that runs the failing module in fp32 (with the rules already in ``policy``), or, for
    code no module rule reaches, what to change there."""
    finfo = f"torch.finfo(x.dtype).min instead of {_number(failure.value)}" if failure.kind == "overflow" else ""
    if not failure.rule:
        where = "there" if not failure.where else f"at {failure.where}"
        return (
            "no fp32_modules rule reaches this code (it is not inside a submodule): "
            + (f"write {finfo} {where}" if finfo else f"compute it in float32 {where} (cast its inputs with .float())")
            + ", or move it into a submodule and keep that in fp32 with policy={'fp32_modules': [...]}."
        )
    rules = list(dict.fromkeys([*policy.fp32_modules, failure.rule]))
    python = "{" + ", ".join(f"{key!r}: {value!r}" for key, value in _fields(policy, rules).items()) + "}"
    yaml = "{" + ", ".join(f"{key}: {_yaml(value)}" for key, value in _fields(policy, rules).items()) + "}"
    line = f"keep it in fp32 with MixedPrecisionPlugin(policy={python}) (YAML: policy: {yaml})".replace("'", '"')
    return line + (f", or write {finfo} in its forward" if finfo else "") + "."


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


def _frames(traceback: Optional[TracebackType]) -> list[Any]:
    frames = []
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    return frames


_CALL_IMPL = nn.Module._call_impl.__code__


def _module_chain(frames: list[Any]) -> tuple[list[nn.Module], Optional[tuple[nn.Module, Any, Any, Any]]]:
    """The modules running when the error left (outermost first, wrappers dropped, from the innermost
    LightningModule on) and the innermost module call ``(module, forward, args, kwargs)`` (``None`` when the error
    came from code outside any module call)."""
    chain: list[nn.Module] = []
    call = None
    for frame in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and (not chain or chain[-1] is not owner):
            chain.append(owner)
        if frame.f_code is _CALL_IMPL:
            call = (
                owner,
                frame.f_locals.get("forward_call"),
                frame.f_locals.get("args", ()),
                frame.f_locals.get("kwargs", {}),
            )
    if call is not None and chain and call[0] is not chain[-1]:
        call = None  # the innermost module's own code raised outside a module call (training_step)
    roots = [i for i, module in enumerate(chain) if _is_lightning_module(module)]
    chain = chain[roots[-1] :] if roots else chain
    while len(chain) > 1 and type(chain[0]).__name__ in WRAPPERS:
        chain = chain[1:]
    return chain, call


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


class _FirstFailure(TorchFunctionMode):
    """Notes the first torch function whose call raises (only top-level calls reach a mode: the op itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: Optional[tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception:
            if self.failed is None:
                self.failed = (func, args, kwargs)
            raise


def _replay(call: tuple[nn.Module, Any, Any, Any], device: str, dtype: torch.dtype) -> tuple[Optional[str], Any]:
    """Run the failing module's forward once more, under the same autocast, to name the op that raises and, for an
    overflow, the value that did not fit."""
    module, forward, args, kwargs = call
    recorder = _FirstFailure()
    try:
        with torch.autocast(device, dtype=dtype, cache_enabled=False), recorder:
            (forward or module.forward)(*args, **kwargs)
    except Exception:
        pass  # the failure being explained, found again
    if recorder.failed is None:
        return None, None
    func, args, kwargs = recorder.failed
    name = resolve_name(func) or getattr(func, "__name__", repr(func))
    found: list[float] = []
    tree_map(lambda v: found.append(float(v)) if _too_large(v, dtype) else None, (args, kwargs))
    return name, (found[0] if found else None)


def _too_large(value: Any, dtype: torch.dtype) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) > torch.finfo(dtype).max


def _largest(dtype_name: str) -> float:
    return torch.finfo(getattr(torch, dtype_name)).max


def _number(value: Optional[float]) -> str:
    if value is None:
        return "a constant"
    return f"{value:g}" if math.isfinite(value) else str(value)
