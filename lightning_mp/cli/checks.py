"""Checks the CLI runs before any work: precision plugins given in ``trainer.plugins``, the strategy, the
``precision_monitor`` options, and ``--ckpt_path`` (the file, its loss-scaler state, its model class and weights).

Each failure is a :class:`CLIConfigError` whose message names the bad value and what would be accepted;
``python -m lightning_mp`` prints it alone (no traceback), before a model is built or a step is trained.
"""

from __future__ import annotations

import importlib
import zipfile
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from lightning_mp.scaler.settings import validated_state


class CLIConfigError(ValueError):
    """A configuration the CLI refuses before any work; the message says what is wrong and what is allowed."""


def import_class(class_path: str) -> Optional[type]:
    """The class named ``package.module.Class``, or ``None`` when it cannot be imported."""
    module_name, _, name = str(class_path).rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name) if module_name else None
    except (ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


def class_spec(value: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """``(class_path, init_args)`` of a jsonargparse class spec (a Namespace or a dict), else ``None``."""
    as_dict = value.as_dict() if hasattr(value, "as_dict") else value
    if isinstance(as_dict, dict) and "class_path" in as_dict:
        return str(as_dict["class_path"]), dict(as_dict.get("init_args") or {})
    return None


def as_list(value: Any) -> list[Any]:
    """``trainer.plugins`` as a list (it may be one value, a list, or ``None``)."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def check_plugin_specs(plugins: Any) -> None:
    """Build each class given in ``trainer.plugins`` once, on its own, so that its own error reaches the user.

    jsonargparse tries every type of Lightning's ``plugins`` union when a plugin's ``__init__`` raises, and ends
    with a long error about ``CheckpointIO`` and ``LayerSync`` that buries the plugin's message.

    Raises:
        CLIConfigError: naming ``trainer.plugins[i]``, its class, and the plugin's own message.
    """
    for index, value in enumerate(as_list(plugins)):
        spec = class_spec(value)
        cls = import_class(spec[0]) if spec is not None else None
        if spec is None or cls is None:
            continue  # strings and unknown paths: Lightning and jsonargparse report those themselves
        parser = ArgumentParser(exit_on_error=False)
        parser.add_argument("--plugin", type=cls)
        try:
            parsed = parser.parse_object({"plugin": {"class_path": spec[0], "init_args": spec[1]}})
            instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
            instantiate(parsed)
        except Exception as err:
            raise CLIConfigError(f"trainer.plugins[{index}] ({spec[0]}): {err}") from err


def check_dependencies(key: str, value: Any) -> None:
    """Ask the class given for ``key`` (``model``, ``data``) whether the packages its settings need are installed,
    before any work: a class may define ``check_dependencies(**init_args)`` (a static or class method), which raises
    :class:`~lightning_mp.samples.resources.MissingExtraError` or
    :class:`~lightning_mp.samples.resources.SourceUnavailableError` naming what is missing and how to install it. The
    samples do; a class without the method is not asked.

    Raises:
        CLIConfigError: the class's own message, for a missing package (a ``SourceUnavailableError`` is raised as it
            is: ``python -m lightning_mp`` prints it alone too).
    """
    from lightning_mp.samples.resources import MissingExtraError

    spec = class_spec(value)
    cls = import_class(spec[0]) if spec is not None else None
    check = getattr(cls, "check_dependencies", None)
    if spec is None or not callable(check):
        return
    try:
        check(**spec[1])
    except MissingExtraError as err:
        raise CLIConfigError(str(err)) from err


def check_strategy(strategy: Any, plugin_from: str) -> None:
    """Refuse, right after parsing, a ``trainer.strategy`` that cannot run ``MixedPrecisionPlugin`` (``plugin_from``
    says what asked for the plugin: ``"trainer.precision='bf16-mixed'"`` or ``"trainer.plugins"``).

    Raises:
        CLIConfigError: FSDP1 (``fsdp``, ``fsdp_cpu_offload``, an ``FSDPStrategy``) or DeepSpeed, with what to use.
    """
    spec = class_spec(strategy)
    cls = import_class(spec[0]) if spec is not None else type(strategy) if not isinstance(strategy, str) else None
    name = repr(strategy) if isinstance(strategy, str) else spec[0] if spec is not None else type(strategy).__name__
    if (cls is not None and issubclass(cls, DeepSpeedStrategy)) or str(strategy).startswith("deepspeed"):
        raise CLIConfigError(
            f"trainer.strategy={name} with MixedPrecisionPlugin (from {plugin_from}): DeepSpeed runs its own loss "
            "scaler, fp32 master weights and clipping, and a second scaler on top would scale the loss twice. Use "
            "--trainer.strategy ddp with the plugin, or let DeepSpeed do it: --trainer.precision null and "
            "--trainer.plugins '{class_path: lightning.pytorch.plugins.precision.DeepSpeedPrecision, init_args: "
            "{precision: 16-mixed}}' (or bf16-mixed)."
        )
    if (cls is not None and issubclass(cls, FSDPStrategy)) or (
        isinstance(strategy, str) and strategy in FSDPStrategy.get_registered_strategies()
    ):
        raise CLIConfigError(
            f"trainer.strategy={name} with MixedPrecisionPlugin (from {plugin_from}): Lightning's FSDPStrategy "
            "(FSDP1) takes only its own FSDPPrecision plugin. Use --trainer.strategy ddp with the plugin, or FSDP2 "
            "(ModelParallelStrategy, with a model whose configure_model calls fully_shard with "
            "trainer.precision_plugin.fsdp2_policy(); see 'Many devices'), or keep fsdp without the plugin: "
            "--trainer.precision null and --trainer.plugins '{class_path: "
            "lightning.pytorch.plugins.precision.FSDPPrecision, init_args: {precision: 16-mixed}}'."
        )


def check_monitor_options(options: dict[str, Any]) -> None:
    """Build ``PrecisionMonitor(**options)`` once, so a bad ``--precision_monitor.*`` value is refused at start.

    Raises:
        CLIConfigError: the monitor's own message (the argument, the value, what is allowed).
    """
    from lightning_mp.diagnostics import PrecisionMonitor

    try:
        PrecisionMonitor(**options)
    except (ValueError, TypeError) as err:
        raise CLIConfigError(f"precision_monitor options refused: {err}") from err


# ------------------------------------------------------------------------------------------- --ckpt_path
#: ``--ckpt_path`` values that Lightning resolves itself (not files)
SPECIAL_CKPT_PATHS = ("last", "best", "hpc", "registry")
_META = "meta.pt"  # what Lightning writes beside the shards of a distributed checkpoint


def check_checkpoint_file(ckpt_path: Optional[str], scaler_defaults: Optional[dict[str, Any]] = None) -> None:
    """Refuse a ``--ckpt_path`` that is not a checkpoint this run can load, naming the file and what is wrong with it
    (missing, a folder, empty, unreadable, not a Lightning checkpoint, or a loss-scaler state out of range), before
    any model is built. A distributed checkpoint (a folder with ``meta.pt``) is checked through its ``meta.pt``.

    Args:
        ckpt_path: the path given (``None``, ``"last"``, ``"best"`` and URLs are left to Lightning).
        scaler_defaults: ``DynamicLossScaler.state_dict()`` of this run's scaler: settings an older checkpoint lacks.

    Raises:
        CLIConfigError: one sentence naming ``ckpt_path``.
    """
    if not ckpt_path or ckpt_path in SPECIAL_CKPT_PATHS or "://" in str(ckpt_path):
        return
    path, where = Path(ckpt_path), f"--ckpt_path {ckpt_path}"
    if not path.exists():
        raise CLIConfigError(f"{where}: no such file (relative paths start from {Path.cwd()}).")
    if path.is_dir():
        if not (path / _META).is_file():
            inside = sorted(p.name for p in path.iterdir() if p.name.endswith(".ckpt"))[:5]
            shown = f" ({', '.join(inside)} in it)" if inside else ""
            raise CLIConfigError(
                f"{where} is a folder{shown}, not a checkpoint: pass a .ckpt file, or a distributed "
                f"checkpoint folder (one with {_META} in it)."
            )
        path, where = path / _META, f"{where} ({_META})"
    size = path.stat().st_size
    if size == 0:
        raise CLIConfigError(
            f"{where} is an empty file (0 bytes), as a save cut short leaves it: pass another checkpoint."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as err:
        raise CLIConfigError(
            f"{where} is not a checkpoint torch.load can read ({size} bytes): {_load_error(path, err)}."
        ) from err
    if not isinstance(checkpoint, dict):
        raise CLIConfigError(
            f"{where} holds a {type(checkpoint).__name__}, not a Lightning checkpoint (a dict with "
            "'state_dict', 'global_step', ...)."
        )
    if "state_dict" not in checkpoint and path.name != _META:
        bare = checkpoint and all(isinstance(value, torch.Tensor) for value in checkpoint.values())
        what = f"a bare state dict ({len(checkpoint)} tensors)" if bare else f"keys {sorted(checkpoint)[:8]}"
        raise CLIConfigError(
            f"{where} holds {what} and no 'state_dict': it is not a checkpoint the Trainer wrote "
            "(load a bare state dict with model.load_state_dict(torch.load(path)) instead)."
        )
    check_scaler_states(checkpoint, where, scaler_defaults)


def check_scaler_states(checkpoint: dict[str, Any], where: str, defaults: Optional[dict[str, Any]] = None) -> None:
    """Check every ``DynamicLossScaler`` state in ``checkpoint`` (``checkpoint[<plugin class>]['scaler']``) with the
    scaler's own rules (:func:`lightning_mp.scaler.settings.validated_state`), so that a hand-edited or corrupt one is
    refused at start rather than when the Trainer restores it.

    Raises:
        CLIConfigError: naming ``where``, the key, the value and what is allowed.
    """
    if defaults is None:
        from lightning_mp.scaler import DynamicLossScaler

        defaults = DynamicLossScaler().state_dict()
    for key, state in checkpoint.items():
        scaler = state.get("scaler") if isinstance(state, dict) else None
        if isinstance(scaler, dict) and "hysteresis_tracker" in scaler:
            try:
                validated_state(scaler, defaults=defaults, source=f"{where}: [{key!r}]['scaler']")
            except (KeyError, ValueError) as err:
                raise CLIConfigError(str(err.args[0]) if err.args else repr(err)) from err


def _load_error(path: Path, err: Exception) -> str:
    if not zipfile.is_zipfile(path):
        with path.open("rb") as handle:
            head = handle.read(16)
        return f"it is not a file torch.save wrote (no zip archive; it starts with {head!r})"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
    return f"{type(err).__name__}: {detail}"


def _load(ckpt_path: str) -> Optional[dict[str, Any]]:
    """The checkpoint, memory-mapped; ``None`` when it cannot be read that way (Lightning's own load then reports
    what is wrong with it)."""
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(ckpt_path))
    except Exception:
        return None
    return checkpoint if isinstance(checkpoint, dict) else None


def checkpoint_model_class(ckpt_path: str) -> tuple[Optional[str], dict[str, Any]]:
    """``(class path, hyperparameters)`` of the LightningModule that wrote the checkpoint (``None`` if not recorded)."""
    checkpoint = _load(ckpt_path) or {}
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams.pop("_instantiator", None)
    return hparams.pop("_class_path", None), hparams


def check_checkpoint_class(
    ckpt_path: Optional[str], config_class_path: Optional[str], config_init_args: Optional[dict[str, Any]] = None
) -> dict[str, tuple[Any, Any]]:
    """Refuse a checkpoint written by another LightningModule class than the one the config trains.

    LightningCLI (2.6) replaces the config's model with the one recorded in the checkpoint, so a checkpoint of
    another model otherwise crashes in the first step (the other model gets batches it cannot read). For the same
    class it takes the checkpoint's settings over the config's: those that differ are returned as
    ``{name: (checkpoint value, config value)}``, for the CLI to say so.

    Raises:
        CLIConfigError: naming both classes and the checkpoint.
    """
    if not ckpt_path or not Path(ckpt_path).is_file() or not config_class_path:
        return {}
    saved_path, hparams = checkpoint_model_class(ckpt_path)
    if saved_path is None:
        return {}
    saved, configured = import_class(saved_path), import_class(config_class_path)
    same = saved is not None and saved is configured
    if same or (saved is None and configured is not None and saved_path.rpartition(".")[2] == configured.__name__):
        given = config_init_args or {}
        return {key: (value, given[key]) for key, value in hparams.items() if key in given and given[key] != value}
    settings = ", ".join(f"{key}={value!r}" for key, value in hparams.items())
    raise CLIConfigError(
        f"--ckpt_path {ckpt_path} was saved from a {saved_path.rpartition('.')[2]} ({settings}), but this run's "
        f"model is {config_class_path}. A checkpoint resumes or evaluates only the model it was saved from: pass a "
        f"checkpoint of {config_class_path.rpartition('.')[2]}, or the config of the run that wrote this one (its "
        "config.yaml is saved next to its lightning_logs/version_N/ folder)."
    )


def check_checkpoint_weights(ckpt_path: Optional[str], model: LightningModule, limit: int = 5) -> None:
    """Refuse a checkpoint whose weights do not fit ``model`` (parameter names or shapes), before any work.

    Models that build their layers in ``configure_model`` are not checked here (their weights do not exist yet).

    Raises:
        CLIConfigError: listing up to ``limit`` missing, unexpected and mis-shaped entries of each kind.
    """
    if not ckpt_path or not Path(ckpt_path).is_file():
        return
    if type(model).configure_model is not LightningModule.configure_model:
        return
    checkpoint = _load(ckpt_path)
    if checkpoint is None:
        return
    saved = checkpoint.get("state_dict")
    if not isinstance(saved, dict):
        raise CLIConfigError(f"--ckpt_path {ckpt_path} holds no model state_dict: it is not a Lightning checkpoint.")
    expected = model.state_dict()
    missing = [key for key in expected if key not in saved]
    unexpected = [key for key in saved if key not in expected]
    reshaped = [
        f"{key} {tuple(saved[key].shape)} in the checkpoint vs {tuple(value.shape)} here"
        for key, value in expected.items()
        if key in saved and hasattr(saved[key], "shape") and tuple(saved[key].shape) != tuple(value.shape)
    ]
    problems = [
        f"{label} ({len(items)}): {', '.join(items[:limit])}{', ...' if len(items) > limit else ''}"
        for label, items in (
            ("not in the checkpoint", missing),
            ("not in the model", unexpected),
            ("different shapes", reshaped),
        )
        if items
    ]
    if problems:
        raise CLIConfigError(
            f"--ckpt_path {ckpt_path} does not fit the model {type(model).__name__}: " + "; ".join(problems) + ". "
            "Pass a checkpoint saved from this model with these settings, or the config of the run that wrote it."
        )
