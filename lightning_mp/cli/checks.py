"""Checks the CLI runs before any work: precision plugins given in ``trainer.plugins``, and ``--ckpt_path``.

Each failure is a :class:`CLIConfigError` whose message names the bad value and what would be accepted;
``python -m lightning_mp`` prints it alone (no traceback), before a model is built or a step is trained.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Optional

import torch
from jsonargparse import ArgumentParser
from lightning.pytorch import LightningModule


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
        except Exception as err:  # noqa: BLE001 - any failure of the user's plugin is reported with its message
            raise CLIConfigError(f"trainer.plugins[{index}] ({spec[0]}): {err}") from err


# ------------------------------------------------------------------------------------------- --ckpt_path


def _load(ckpt_path: str) -> Optional[dict[str, Any]]:
    """The checkpoint, memory-mapped; ``None`` when it cannot be read that way (Lightning's own load then reports
    what is wrong with it)."""
    try:
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not ours to report: the Trainer loads it next and raises its own error
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
        for label, items in (("not in the checkpoint", missing), ("not in the model", unexpected),
                             ("different shapes", reshaped))
        if items
    ]
    if problems:
        raise CLIConfigError(
            f"--ckpt_path {ckpt_path} does not fit the model {type(model).__name__}: " + "; ".join(problems) + ". "
            "Pass a checkpoint saved from this model with these settings, or the config of the run that wrote it."
        )
