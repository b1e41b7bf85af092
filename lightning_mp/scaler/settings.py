"""The rules every loss-scaler setting follows, shared by the constructor and ``load_state_dict``; the checkpoint's
form of the state (its keys, a state written by another plugin); and what the plugin's ``scaler=`` argument means.

Each check names the bad value and what is allowed, and refuses what Python would otherwise coerce silently: a
string where a number belongs (``"2"``), a bool where a number belongs, ``enabled="no"``, a scale beyond fp32.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any, Optional

import torch

#: The largest finite fp32 value: no scale may exceed it (the scale is held in an fp32 tensor).
FP32_MAX = float(torch.finfo(torch.float32).max)
#: A scaler's counters (the fields of its :class:`~lightning_mp.scaler.rules.ScalerState` but the scale), in
#: ``state_dict()``'s order, after "scale": the checkpoint's format, kept as it was.
COUNTER_NAMES = ("growth_tracker", "hysteresis_tracker", "steps", "skipped_steps", "consecutive_skips")
#: A scaler's settings (its attributes of these names), in the order ``state_dict()`` writes them after the counters.
SETTING_NAMES = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "min_scale",
    "max_scale",
    "dynamic",
    "check_only",
    "enabled",
    "max_consecutive_skips",
)


def validated_settings(
    init_scale: Any,
    growth_factor: Any,
    backoff_factor: Any,
    growth_interval: Any,
    hysteresis: Any,
    min_scale: Any,
    max_scale: Any,
    enabled: Any,
    max_consecutive_skips: Any,
    dynamic: Any = True,
    check_only: Any = False,
    scale_name: str = "init_scale",
) -> dict[str, Any]:
    """The constructor's rules, shared with ``load_state_dict``: every value checked, converted, returned."""
    settings: dict[str, Any] = {
        "init_scale": check_number(scale_name, init_scale, low=0.0, high=FP32_MAX),
        "min_scale": check_number("min_scale", min_scale, low=0.0, high=FP32_MAX),
        "max_scale": check_number("max_scale", max_scale, low=0.0, high=FP32_MAX),
        "growth_factor": check_number("growth_factor", growth_factor, low=1.0, high=math.inf),
        "backoff_factor": check_number("backoff_factor", backoff_factor, low=0.0, high=1.0, high_open=True),
        "growth_interval": check_int("growth_interval", growth_interval, low=1),
        "hysteresis": check_int("hysteresis", hysteresis, low=1),
        "enabled": check_bool("enabled", enabled),
        "dynamic": check_bool("dynamic", dynamic),
        "check_only": check_bool("check_only", check_only),
        "max_consecutive_skips": (
            None if max_consecutive_skips is None else check_int("max_consecutive_skips", max_consecutive_skips, low=1)
        ),
    }
    if settings["min_scale"] > settings["max_scale"]:
        raise ValueError(f"min_scale={min_scale!r} is larger than max_scale={max_scale!r}: it must be <= max_scale.")
    if not settings["min_scale"] <= settings["init_scale"] <= settings["max_scale"]:
        raise ValueError(
            f"{scale_name}={init_scale!r} is outside [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]."
        )
    return settings


def check_number(name: str, value: Any, low: float, high: float, high_open: bool = False) -> float:
    """A real number (not a bool, not a string) in ``(low, high]`` (``(low, high)`` when ``high_open``)."""
    allowed = f"a finite number > {low:g}"
    if math.isfinite(high):
        allowed += f" and {'<' if high_open else '<='} {high:g}" + (" (the largest fp32)" if high == FP32_MAX else "")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}={value!r} is not allowed: it must be {allowed}, not a {type(value).__name__}.")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not (math.isfinite(number) and low < number and (number < high if high_open else number <= high)):
        raise ValueError(f"{name}={value!r} is not allowed: it must be {allowed}.")
    return number


def check_int(name: str, value: Any, low: int, high: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        raise ValueError(f"{name}={value!r} is not allowed: it must be {allowed}.")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not allowed: it must be True or False.")
    return value


def validated_state(state_dict: Any, defaults: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A saved ``DynamicLossScaler`` state checked with the constructor's rules: ``(settings, counters)``.

    ``defaults`` (the scaler's own ``state_dict()``) fills settings an older checkpoint lacks; counters it lacks
    start at 0. Raises ``KeyError`` for a missing required key, ``ValueError`` naming key, value and ``source``.
    """
    if not isinstance(state_dict, dict):
        raise ValueError(f"{source} is a {type(state_dict).__name__}, not a DynamicLossScaler state (a dict).")
    missing = sorted({"scale", "growth_tracker", "hysteresis_tracker", "skipped_steps"} - set(state_dict))
    if missing:
        raise KeyError(f"{source} lacks DynamicLossScaler keys {missing}; got keys {sorted(state_dict)}.")
    merged = {**defaults, "steps": 0, "consecutive_skips": 0, **state_dict}
    try:
        settings = validated_settings(
            init_scale=merged["scale"],
            growth_factor=merged["growth_factor"],
            backoff_factor=merged["backoff_factor"],
            growth_interval=merged["growth_interval"],
            hysteresis=merged["hysteresis"],
            min_scale=merged["min_scale"],
            max_scale=merged["max_scale"],
            enabled=merged["enabled"],
            max_consecutive_skips=merged["max_consecutive_skips"],
            dynamic=merged["dynamic"],
            check_only=merged["check_only"],
            scale_name="scale",
        )
        counters = {
            "growth_tracker": check_int("growth_tracker", merged["growth_tracker"], low=0),
            "hysteresis_tracker": check_int(
                "hysteresis_tracker", merged["hysteresis_tracker"], low=0, high=settings["hysteresis"]
            ),
            "steps": check_int("steps", merged["steps"], low=0),
            "skipped_steps": check_int("skipped_steps", merged["skipped_steps"], low=0),
            "consecutive_skips": check_int("consecutive_skips", merged["consecutive_skips"], low=0),
        }
    except ValueError as error:
        raise ValueError(f"{source}: {error} The checkpoint is corrupt or was edited by hand.") from error
    return settings, counters


def foreign_scaler_state(checkpoint: dict[str, Any], hysteresis: int) -> Optional[tuple[dict[str, Any], str]]:
    """A plugin state in a checkpoint written by another plugin class: ``({"scaler": state}, source)``, or ``None``.

    Either a subclass of ``MixedPrecisionPlugin`` (a key whose value holds our scaler state) or Lightning's
    built-in ``MixedPrecision`` (a ``torch.amp.GradScaler`` state, converted to ours).
    """
    for key, state in checkpoint.items():
        if isinstance(state, dict) and "hysteresis_tracker" in state.get("scaler", {}):
            return state, f"checkpoint[{key!r}]"
    torch_state = checkpoint.get("MixedPrecision")
    if isinstance(torch_state, dict) and "scale" in torch_state:
        kept = ("growth_factor", "backoff_factor", "growth_interval")
        return {
            "scaler": {
                **{key: torch_state[key] for key in kept if key in torch_state},
                "scale": float(torch_state["scale"]),
                "growth_tracker": int(torch_state.get("_growth_tracker", 0)),
                "hysteresis_tracker": hysteresis,
                "skipped_steps": 0,
            }
        }, "checkpoint['MixedPrecision'] (Lightning's built-in GradScaler state)"
    return None


def scaler_for_precision(cls: Any, precision: str, scaler: Any) -> Any:
    """``DynamicLossScaler.for_precision``: what ``MixedPrecisionPlugin(precision, scaler=...)`` means.

    ``16-mixed``: ``None`` -> a default dynamic scaler; a number -> :meth:`static`; a mapping -> constructor
    arguments; a scaler as given. ``bf16-mixed`` scales nothing: ``None`` -> :meth:`check_only`; a mapping
    takes only ``enabled`` and ``max_consecutive_skips``; a scaler must be check-only or disabled.
    """
    bf16 = precision == "bf16-mixed"
    if isinstance(scaler, cls):
        if bf16 and scaler.enabled and not scaler.check_only:
            raise ValueError(
                f"precision='bf16-mixed' does not use loss scaling, but scaler={scaler!r} was given: "
                "pass scaler=None (skip non-finite steps, no scaling), DynamicLossScaler.check_only(...), "
                "DynamicLossScaler(enabled=False) (no check), or use precision='16-mixed'."
            )
        return scaler
    if isinstance(scaler, Mapping):  # settings from YAML or the CLI
        allowed = ["enabled", "max_consecutive_skips"] if bf16 else list(inspect.signature(cls).parameters)
        unknown = sorted(set(scaler) - set(allowed))
        if unknown:
            raise ValueError(
                f"scaler settings {unknown} are not allowed with precision={precision!r}: use {allowed}"
                + (" (bf16 does not scale the loss)." if bf16 else ".")
            )
        if not bf16:
            return cls(**scaler)
        settings = dict(scaler)
        return cls(enabled=False) if settings.pop("enabled", True) is False else cls.check_only(**settings)
    if scaler is None:
        return cls.check_only() if bf16 else cls()
    if isinstance(scaler, (int, float)) and not isinstance(scaler, bool):
        if bf16:
            raise ValueError(
                f"precision='bf16-mixed' does not use loss scaling, but a static scale scaler={scaler!r} was "
                "given: pass scaler=None, or use precision='16-mixed'."
            )
        return cls.static(scaler)
    raise ValueError(
        f"scaler={scaler!r} is not supported: pass None, a lightning_mp.DynamicLossScaler, a number > 0 "
        "for a static scale, or a mapping of DynamicLossScaler arguments."
    )
