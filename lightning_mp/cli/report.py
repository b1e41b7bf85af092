"""What the CLI shows about precision: ``--print_config`` of what will train, and the paragraph that ends every
``fit`` (what the precision machinery did, and where the checkpoints and logs are)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
import yaml
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_mp.cli.checkpoints import LastCheckpoint
from lightning_mp.cli.checks import as_list
from lightning_mp.plugin import MixedPrecisionPlugin
from lightning_mp.standalone import trainer_callbacks


def fit_summary(trainer: L.Trainer, precision: str, tested_on: Optional[str] = None, extra: Sequence[str] = ()) -> str:
    """One paragraph: the optimizer steps this run trained (counted from where a resume started, when the CLI's
    :class:`StepsThisRun` is attached), the precision used and why (``precision``), the loss scale and skipped
    steps (of the whole run, resumes included), master weights on/off, the checkpoints (last and best), the logs.

    Args:
        trainer: the Trainer after ``fit``.
        precision: what trained and why, one sentence (``PrecisionChoice.describe()``).
        tested_on: the checkpoint the test set was evaluated on after fit (``"final weights"`` or a path), or
            ``None`` when no test ran.
        extra: more sentences to append (e.g. where a diagnostics report was written).
    """
    steps = trainer.global_step
    sentences = [_steps_sentence(trainer), _sentence(precision)]
    sentences.append(_numerics(trainer.precision_plugin, steps))
    sentences.extend(_checkpoints(trainer))
    if tested_on is not None:
        sentences.append(f"Test set evaluated on {tested_on}.")
    logs = _logs(trainer)
    if logs:
        sentences.append(logs)
    sentences.extend(_sentence(line) for line in extra)
    return " ".join(sentences)


class StepsThisRun(Callback):
    """Records the optimizer step ``fit`` starts from, after a resume restored it, so that the summary counts this
    run's steps (``trainer.global_step`` counts those of the runs it resumed too)."""

    def __init__(self) -> None:
        self.first_step: Optional[int] = None  # None: training never started (a resume with nothing left to do)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.first_step = trainer.global_step


def _steps_sentence(trainer: L.Trainer) -> str:
    total = trainer.global_step
    ending = " (interrupted)" if trainer.interrupted else ""
    counters = [callback for callback in trainer_callbacks(trainer) if isinstance(callback, StepsThisRun)]
    if not counters:  # not run by the CLI: the Trainer's count
        return f"lightning_mp: fit ran {total} optimizer steps{ending}."
    first = counters[0].first_step
    if first is None and total > 0:
        reached = (
            f"max_steps={trainer.max_steps}" if 0 <= trainer.max_steps <= total else f"max_epochs={trainer.max_epochs}"
        )
        return (
            f"lightning_mp: fit ran no optimizer step: it resumed at step {total}, where {reached} was already "
            f"reached{ending}."
        )
    first = first or 0
    resumed = f", resuming at step {first} ({total} in all)" if first else ""
    return f"lightning_mp: fit ran {total - first} optimizer steps{resumed}{ending}."


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _numerics(plugin: object, steps: int) -> str:
    if not isinstance(plugin, MixedPrecisionPlugin):
        return "No MixedPrecisionPlugin: no loss scaling, no master weights."
    masters = "on (fp32 masters, half-precision model)" if plugin.master_weights else "off"
    if plugin.steps.weights.lean:
        masters = "on (bf16 model + 16-bit remainders: exact fp32 masters, no fp32 copy)"
    scaler = plugin.scaler
    if scaler is None or not scaler.enabled:
        scaling = "no inf/NaN check (scaler disabled)"
    else:
        skipped = f"{scaler.skipped_steps} of {steps} steps skipped for inf/NaN gradients"
        scale = "no loss scaling (bf16 needs none)" if scaler.check_only else f"final loss scale {scaler.scale:g}"
        scaling = f"{scale}, {skipped}"
    return f"Plugin numerics: {scaling}; master weights {masters}."


def _checkpoints(trainer: L.Trainer) -> list[str]:
    found = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        if isinstance(callback, LastCheckpoint) or (callback.save_last and not callback.monitor):
            if callback.last_model_path:
                found.append(f"Last checkpoint (resume with --ckpt_path): {callback.last_model_path}.")
        elif callback.monitor and callback.best_model_path:
            score = callback.best_model_score
            shown = f", {callback.monitor}={float(score):.4g}" if score is not None else ""
            found.append(f"Best checkpoint ({callback.mode} {callback.monitor}{shown}): {callback.best_model_path}.")
        elif callback.best_model_path:
            found.append(f"Checkpoint: {callback.best_model_path}.")
    return found or ["No checkpoint was written."]


def _logs(trainer: L.Trainer) -> str:
    folders = []
    for logger in trainer.loggers:
        folder = getattr(logger, "log_dir", None)
        if folder and folder not in folders:
            metrics = Path(folder) / "metrics.csv"
            folders.append(str(metrics) if metrics.is_file() else str(folder))
    return f"Logs: {', '.join(folders)}." if folders else ""


# ------------------------------------------------------------------------------------------ --print_config


def pop_print_config(args: Any) -> tuple[Any, Optional[str]]:
    """``args`` without ``--print_config[=flags]`` (from ``sys.argv`` when ``args`` is None), and the flags given
    (``""`` for none), or ``None`` when it was not given."""
    argv = sys.argv[1:] if args is None else args
    if not isinstance(argv, (list, tuple)):
        return args, None
    flags = [a.partition("=")[2] for a in argv if a == "--print_config" or a.startswith("--print_config=")]
    if not flags:
        return args, None
    return [a for a in argv if not (a == "--print_config" or a.startswith("--print_config="))], ",".join(flags)


def effective_config_yaml(
    dumped_yaml: str, subcommand: Optional[str], choice: Any, plugin_defaults: dict[str, Any], skip_none: bool = False
) -> str:
    """The parsed config (``dumped_yaml``, the parser's dump) with ``trainer.precision`` and ``mixed_precision``
    replaced by what trains here (``choice``, a ``PrecisionChoice``): ``MixedPrecisionPlugin`` and its settings in
    ``trainer.plugins``, or ``precision: 32-true`` for the fp32 fallback. A comment at the top says what was
    translated and why."""
    dumped = yaml.safe_load(dumped_yaml)
    if subcommand:
        dumped = dumped[subcommand]
    dumped.pop("mixed_precision", None)  # shown as the plugin it builds, with its options as given
    trainer = dumped.setdefault("trainer", {})
    if choice.plugin is not None:
        init_args = {"precision": choice.plugin.precision, **plugin_defaults, **choice.options}
        if "scaler" in choice.unused:
            init_args["scaler"] = None
        trainer["precision"] = None
        trainer["plugins"] = [
            *as_list(trainer.get("plugins")),
            {"class_path": "lightning_mp.MixedPrecisionPlugin", "init_args": init_args},
        ]
    elif choice.fallback:
        trainer["precision"] = choice.trains  # 32-true
    if skip_none:
        dumped = _drop_none(dumped)
    header = [f"# lightning_mp: {choice.describe('trains')}."]
    if choice.unused:
        header.append(f"# mixed_precision options not used here: {list(choice.unused)}.")
    if choice.fallback:
        header.append(
            f"# What trains on this machine; trainer.precision={choice.requested!r} in the config you gave "
            "chooses again on another one."
        )
    return "\n".join(header) + "\n" + yaml.safe_dump(dumped, sort_keys=False)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
