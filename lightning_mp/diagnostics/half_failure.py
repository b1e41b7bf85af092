"""Half-precision failures that are not overflows of the gradients: an op with no fp16/bf16 kernel on the device
(``nn.LSTM`` under fp16 autocast on a CPU: ``could not create a primitive descriptor for the LSTM forward
propagation primitive``), a constant too large for the half tensor it is written into (``x.masked_fill(mask, -1e9)``
on fp16: ``value cannot be converted to type c10::Half without overflow``), or another error that names a half
dtype. Such an error ends the run at the first forward, far from its cause, and a model often has more than one.

:class:`ExplainingAutocast` is the plugin's ``torch.autocast``: on the normal path it is that context and nothing
more (no hook, no mode, no per-op Python). When an error leaves the forward it runs the outermost module call of the
model that failed (the model's ``forward``, with every submodule) once more, through each op that fails in the half
dtype (each run in fp32 to go on: :mod:`lightning_mp.diagnostics.half_replay`), and raises one
:class:`HalfPrecisionError` naming every failure of that forward and the one cast-policy line that fixes them all,
``from None`` (the original error, with its traceback through torch's internals, is kept as ``.original``). An
error it cannot explain is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, replace
from types import TracebackType
from typing import Any, Optional, Union

import torch

from lightning_mp.diagnostics.half_replay import (
    HALF_NAMES,
    HalfFailure,
    frames_of,
    from_traceback,
    kind_of,
    module_chain,
    number,
    replay,
)
from lightning_mp.policy import CastPolicy

__all__ = ["ExplainingAutocast", "HalfFailure", "HalfPrecisionError", "explain", "fix_for", "fix_for_all", "kind_of"]


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


def explain(error: BaseException, device: str, dtype: torch.dtype, policy: CastPolicy) -> Optional[HalfPrecisionError]:
    """The :class:`HalfPrecisionError` behind ``error`` raised inside a ``dtype`` autocast on ``device`` (every
    failure of the forward it left), or ``None`` when it is not a half-precision failure. Runs only on the failure
    path; never raises."""
    kind = kind_of(error, dtype)
    if kind is None or dtype not in HALF_NAMES:
        return None
    try:
        return _explain(error, kind, device, dtype, policy)
    except Exception:  # an explanation that fails leaves the original error as it was (raised by the caller)
        return None


def _explain(
    error: BaseException, kind: str, device: str, dtype: torch.dtype, policy: CastPolicy
) -> HalfPrecisionError:
    frames = frames_of(error.__traceback__)
    chain, outer = module_chain(frames)
    failures: list[HalfFailure] = []
    stopped = ""
    if outer is not None:  # the model's forward that failed, once more: every failure it meets
        failures, stopped = replay(outer, chain[0], device, dtype, policy)
    if not failures:  # training_step's own code (no module call to run again), or the forward did not fail again
        failures = [from_traceback(error, kind, frames, chain, device, dtype)]
        stopped = ""
    fix = fix_for_all(failures, policy)
    return HalfPrecisionError([replace(failure, fix=fix) for failure in failures], original=error, stopped=stopped)


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
            )
            + ", or move it into a submodule and keep that in fp32 with policy={'fp32_modules': [...]}"
        )
    return "; and ".join(parts) + "."


def _finfo(failure: HalfFailure) -> str:
    return f"torch.finfo(x.dtype).min instead of {number(failure.value)}"


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
