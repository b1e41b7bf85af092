"""The paragraph that ends every CLI ``fit``: what the precision machinery did, and where the results are."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_mp.checkpoints import LastCheckpoint
from lightning_mp.plugin import MixedPrecisionPlugin


def fit_summary(
    trainer: L.Trainer,
    precision: str,
    tested_on: Optional[str] = None,
    extra: Sequence[str] = (),
) -> str:
    """One paragraph: steps trained, the precision used and why (``precision``), the loss scale and skipped steps,
    master weights on/off, the checkpoints (last and best) and the logs.

    Args:
        trainer: the Trainer after ``fit``.
        precision: what trained and why, one sentence (``PrecisionChoice.describe()``).
        tested_on: the checkpoint the test set was evaluated on after fit (``"final weights"`` or a path), or
            ``None`` when no test ran.
        extra: more sentences to append (e.g. where a diagnostics report was written).
    """
    steps = trainer.global_step
    ending = " (interrupted)" if trainer.interrupted else ""
    sentences = [f"lightning_mp: fit ran {steps} optimizer steps over {trainer.current_epoch} epochs{ending}.",
                 _sentence(precision)]
    sentences.append(_numerics(trainer.precision_plugin, steps))
    sentences.extend(_checkpoints(trainer))
    if tested_on is not None:
        sentences.append(f"Test set evaluated on {tested_on}.")
    logs = _logs(trainer)
    if logs:
        sentences.append(logs)
    sentences.extend(_sentence(line) for line in extra)
    return " ".join(sentences)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _numerics(plugin: Any, steps: int) -> str:
    if not isinstance(plugin, MixedPrecisionPlugin):
        return "No MixedPrecisionPlugin: no loss scaling, no master weights."
    masters = "on (fp32 masters, half-precision model)" if plugin.master_weights else "off"
    scaler = plugin.scaler
    if scaler is None or not scaler.enabled:
        scaling = "no loss scaling (bf16 needs none)" if plugin.precision == "bf16-mixed" else "loss scaling off"
    else:
        scaling = f"final loss scale {scaler.scale:g}, {scaler.skipped_steps} of {steps} steps skipped for inf/NaN gradients"
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
