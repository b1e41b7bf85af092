"""What ``trainer.precision``, ``trainer.plugins`` and ``mixed_precision`` train with, and why:
:func:`choose_precision` makes a :class:`PrecisionChoice` (with the CPU fallback: bf16 where the CPU has native bf16,
fp32 elsewhere) and :func:`plugin_for` the plugin the CLI adds to the Trainer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_mp.cli.checks import CLIConfigError, as_list, class_spec, import_class
from lightning_mp.cpu import cpu_has_native_bf16
from lightning_mp.plugin import MixedPrecisionPlugin, PrecisionName


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``trainer.precision``, ``trainer.plugins`` and the ``mixed_precision`` section train with here.

    Attributes:
        requested: ``trainer.precision`` as given (``None``: not given).
        trains: what trains: ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, another Lightning precision, or
            ``"trainer.plugins"`` (a precision plugin given there, used as configured).
        reason: why, in one sentence.
        plugin: the plugin the CLI adds to the Trainer (``None``: it adds none).
        options: the ``mixed_precision`` options as given (plain values).
        unused: the options that were set but do not apply to what trains.
        warning: what the CLI warns about at start-up (a fallback, unused options), or ``None``.
        fallback: whether the CPU fallback chose ``trains`` instead of ``requested`` (another machine may choose
            otherwise).
    """

    requested: Optional[str]
    trains: str
    reason: str
    plugin: Optional[MixedPrecisionPlugin] = None
    options: dict[str, Any] = field(default_factory=dict)
    unused: tuple[str, ...] = ()
    warning: Optional[str] = None
    fallback: bool = False

    def what(self, verb: str = "trains", full: bool = False) -> str:
        """``"<verb> in bf16-mixed with MixedPrecisionPlugin"`` and the like (``full``: the plugin's settings too)."""
        if self.plugin is not None:
            shown = repr(self.plugin) if full else "MixedPrecisionPlugin"
            return f"{verb} in {self.trains} with {shown}"
        if self.trains == "trainer.plugins":
            return f"{verb} with the precision plugin in trainer.plugins"
        return f"{verb} in {self.trains} without MixedPrecisionPlugin"

    def describe(self, verb: str = "trains") -> str:
        """One sentence starting with ``verb``: what trains and why."""
        return f"{self.what(verb)}: {self.reason}"


#: ``trainer.precision`` values this plugin trains with, and the precision each means
OUR_PRECISIONS: dict[str, PrecisionName] = {
    "16-mixed": "16-mixed",
    "16": "16-mixed",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
}
#: the ``mixed_precision`` options the CLI hands to the plugin, and their defaults
PLUGIN_OPTIONS = (
    "scaler",
    "master_weights",
    "keep_norm_fp32",
    "policy",
    "reduce_dtype",
    "fp8",
    "optimizer_in_backward",
    "zero_grad_after_step",
)
PLUGIN_DEFAULTS = {
    "scaler": None,
    "master_weights": False,
    "keep_norm_fp32": True,
    "policy": None,
    "reduce_dtype": "float32",
    "fp8": None,
    "optimizer_in_backward": False,
    "zero_grad_after_step": False,
}


def choose_precision(
    precision: Optional[str], accelerator: Optional[str], plugins: Any, options: dict[str, Any]
) -> PrecisionChoice:
    """Decide what trains, validating every ``mixed_precision`` option whatever is chosen.

    The options are checked by building ``MixedPrecisionPlugin(<requested precision>, **options)`` (the default
    precision when ``trainer.precision`` is not a mixed one), so the CLI refuses exactly what the API refuses,
    also where the CPU fallback then trains in bf16 or fp32 and some options do not apply.

    Raises:
        CLIConfigError: any ``precision`` together with a precision plugin in ``trainer.plugins``, two precision
            plugins there, or an option
            that ``MixedPrecisionPlugin`` refuses (the message is the plugin's own).
    """
    precision = None if precision is None else str(precision)
    changed = sorted(key for key, value in options.items() if value != PLUGIN_DEFAULTS.get(key))
    given = _precision_plugins(plugins)
    requested = OUR_PRECISIONS.get(precision or "")
    _validate_options(requested or "16-mixed", options, precision)
    if len(given) > 1:
        raise CLIConfigError(
            f"trainer.plugins holds {len(given)} precision plugins ({', '.join(given)}): Lightning "
            "takes one. Keep the one that should train."
        )
    if given and precision is not None:  # any precision flag: Lightning refuses it next to a precision plugin
        raise CLIConfigError(
            f"trainer.precision={precision!r} and a precision plugin in trainer.plugins ({', '.join(given)}) were "
            "both given: Lightning accepts only one. Drop trainer.precision (--trainer.precision null) to use the "
            "plugin as configured, or drop the plugin (MixedPrecisionPlugin's options go under mixed_precision)."
        )
    if requested is None:
        if given:
            trains, reason = "trainer.plugins", f"{', '.join(given)}, used as configured there"
        else:
            trains = precision or "32-true"
            flag = f"trainer.precision={precision!r}" if precision is not None else "trainer.precision not set"
            reason = f"{flag}: the CLI adds MixedPrecisionPlugin only for 16-mixed or bf16-mixed"
        warning = f"mixed_precision options {changed} are valid but not used: {reason}." if changed else None
        return PrecisionChoice(precision, trains, reason, None, options, tuple(changed), warning)
    if requested == "16-mixed" and _runs_on_cpu(accelerator):
        return _cpu_fallback(precision, options, changed)
    where = "on CPU" if _runs_on_cpu(accelerator) else "on the GPU"
    reason = f"trainer.precision={precision!r} {where}"
    return PrecisionChoice(precision, requested, reason, MixedPrecisionPlugin(requested, **options), options)


def _cpu_fallback(precision: Optional[str], options: dict[str, Any], changed: list[str]) -> PrecisionChoice:
    # 16-mixed without a GPU: bf16 (Lightning's convention) on CPUs with native bf16, else fp32. fp16 and bf16
    # matmuls on CPUs without AVX512-BF16 or AMX run on fallback kernels far slower than fp32 (see
    # benchmarks/RESULTS.md). An explicit MixedPrecisionPlugin in trainer.plugins is honoured as given.
    if cpu_has_native_bf16():
        unused = ("scaler",) if "scaler" in changed else ()
        reason = (
            f"trainer.precision={precision!r} without a GPU, on a CPU with native bf16 (AVX512-BF16 or AMX): "
            "bf16-mixed instead, as Lightning does (fp16 has no fast CPU kernels); for real fp16, put "
            "MixedPrecisionPlugin in trainer.plugins"
        )
        note = "; mixed_precision.scaler is valid but not used (bf16 needs no loss scaling)" if unused else ""
        plugin = MixedPrecisionPlugin("bf16-mixed", **{k: v for k, v in options.items() if k != "scaler"})
        return PrecisionChoice(precision, "bf16-mixed", reason, plugin, options, unused, f"{reason}{note}.", True)
    reason = (
        f"trainer.precision={precision!r} without a GPU, on a CPU with no native bf16 (no AVX512-BF16 or AMX), "
        "where bf16 and fp16 run many times slower than fp32: the CPU fallback chose fp32 (32-true); set "
        "trainer.precision=bf16-mixed, or put MixedPrecisionPlugin in trainer.plugins, to train in half precision"
    )
    note = f"; mixed_precision options {changed} are valid but not used in fp32" if changed else ""
    return PrecisionChoice(precision, "32-true", reason, None, options, tuple(changed), f"{reason}{note}.", True)


def _validate_options(precision: PrecisionName, options: dict[str, Any], flag: Optional[str]) -> None:
    try:
        MixedPrecisionPlugin(precision, **options)
    except (ValueError, TypeError) as err:
        given = (
            f"trainer.precision={flag!r}"
            if flag in OUR_PRECISIONS
            else f"MixedPrecisionPlugin(precision={precision!r})"
        )
        changed = {key: value for key, value in options.items() if value != PLUGIN_DEFAULTS.get(key)}
        raise CLIConfigError(f"mixed_precision options {changed} are refused with {given}: {err}") from err


def has_our_plugin(plugins: Any) -> bool:
    """Whether ``trainer.plugins`` holds a MixedPrecisionPlugin (an instance, or a class spec of it or a subclass)."""
    for value in as_list(plugins):
        cls = type(value) if isinstance(value, Precision) else import_class((class_spec(value) or ("",))[0])
        if cls is not None and issubclass(cls, MixedPrecisionPlugin):
            return True
    return False


def _precision_plugins(plugins: Any) -> list[str]:
    """Names of the precision plugins in ``trainer.plugins`` (instances or class specs not yet instantiated)."""
    names = []
    for value in as_list(plugins):
        if isinstance(value, Precision):
            names.append(type(value).__name__)
        elif (spec := class_spec(value)) is not None:
            cls = import_class(spec[0])
            if cls is not None and issubclass(cls, Precision):
                names.append(cls.__name__)
    return names


def plugin_for(
    precision: Optional[str], accelerator: Optional[str], plugins: Any, options: dict[str, Any]
) -> Optional[MixedPrecisionPlugin]:
    """The plugin that ``trainer.precision`` asks for, or ``None`` (fp32 and other precisions pass through).

    Warns about a CPU fallback or unused options (see :func:`choose_precision`).

    Raises:
        CLIConfigError: see :func:`choose_precision`.
    """
    choice = choose_precision(precision, accelerator, plugins, options)
    if choice.warning:
        rank_zero_warn(choice.warning)
    return choice.plugin


def _runs_on_cpu(accelerator: Optional[str]) -> bool:
    name = str(accelerator or "auto").lower()
    if name == "cpu":
        return True
    if name in ("auto", "gpu", "cuda"):
        return not torch.cuda.is_available() and not (name == "auto" and torch.backends.mps.is_available())
    return False


# ------------------------------------------------------------------------------------------ helpers


def plain_arguments(value: Any) -> Any:
    """jsonargparse hands a scaler mapping over as a class spec Namespace: back to a plain dict of arguments."""
    init_args = getattr(value, "init_args", None)
    if init_args is not None:
        return init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args)
    return value.as_dict() if hasattr(value, "as_dict") else value
