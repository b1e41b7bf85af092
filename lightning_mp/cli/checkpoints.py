"""``LastCheckpoint``: a ``last.ckpt`` that is the latest training state, to resume from after a crash or a kill.

Lightning's ``ModelCheckpoint(monitor=..., save_last=True)`` (2.6) writes ``last.ckpt`` only when it saves a top-k
checkpoint, so its ``last.ckpt`` is a copy of the best one, and resuming from it after a crash silently loses
every epoch since the last improvement. ``LastCheckpoint`` writes ``last.ckpt`` whatever the metrics do.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override


class LastCheckpoint(ModelCheckpoint):
    """Writes ``last.ckpt`` every ``every_n_train_steps`` optimizer steps, at the end of every training epoch and
    when ``fit`` ends (``max_steps`` in mid-epoch included), overwriting the previous one, also one that an earlier
    run left in the same ``dirpath`` (Lightning's ``ModelCheckpoint`` would write ``last-v1.ckpt`` beside it, and a
    resume from ``last.ckpt`` would then silently restore the older run).

    It also puts the states of the random number generators (torch, CUDA, numpy, Python) and of resumable
    training loaders (``state_dict``/``load_state_dict``, such as the sample data modules') in every checkpoint the
    Trainer writes while it is attached, and restores them on resume, so that a resumed run draws the dropout
    masks and the batches the uninterrupted run drew, from mid-epoch checkpoints too. Add a
    ``ModelCheckpoint(monitor=...)`` next to it to keep the best checkpoint.

    Args:
        dirpath: folder of ``last.ckpt`` (default ``None``: the logger's ``checkpoints/`` folder, as
            ``ModelCheckpoint``).
        every_n_train_steps: also write it every this many optimizer steps (default 0: at epoch ends only). A
            kill then loses at most this many steps.
    """

    def __init__(self, dirpath: Optional[str] = None, every_n_train_steps: int = 0) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 0:
            raise ValueError(
                f"every_n_train_steps={every_n_train_steps!r} is not allowed: use an int >= 0 (0: epoch ends only)."
            )
        super().__init__(
            dirpath=dirpath,
            save_top_k=0,
            save_last=True,
            every_n_train_steps=every_n_train_steps,
            save_on_train_epoch_end=True,
            enable_version_counter=False,  # overwrite: never a last-v1.ckpt
        )
        self._train_loaders: list[Any] = []  # the resumable training loaders of the running fit
        self._pending_loader_states: Optional[list[dict[str, Any]]] = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(last_checkpoint=True, every_n_train_steps=self._every_n_train_steps)

    # ModelCheckpoint.on_train_batch_end already writes last.ckpt every `every_n_train_steps` (save_top_k=0 skips
    # the top-k part); epoch ends and the end of fit are added here, where ModelCheckpoint writes last.ckpt only
    # after a top-k save.
    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_latest(trainer)

    def _save_latest(self, trainer: L.Trainer) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # skips a step already saved, sanity checks, non-fit
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning saves the state of resumable training loaders in the checkpoint but, when configure_optimizers
        # asked for trainer.estimated_stepping_batches, never gives it back on resume (Lightning issue 20550: the
        # loaders were built before the restore). So this callback keeps that state too and restores it here,
        # after the loaders exist and before their first batch; loading it twice is harmless.
        self._train_loaders = [loader for loader in _flat(trainer.train_dataloader) if _is_resumable(loader)]
        pending, self._pending_loader_states = self._pending_loader_states, None
        if pending is not None and len(pending) == len(self._train_loaders):
            for loader, state in zip(self._train_loaders, pending):
                loader.load_state_dict(state)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._save_latest(trainer)
        self._train_loaders = []

    @override
    def state_dict(self) -> dict[str, Any]:
        loaders = [loader.state_dict() for loader in self._train_loaders]
        return {**super().state_dict(), "rng_states": rng_states(), "train_loaders": loaders}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "rng_states" in state_dict:
            set_rng_states(state_dict["rng_states"])
        self._pending_loader_states = state_dict.get("train_loaders") or None


def _flat(loaders: Any) -> list[Any]:
    if isinstance(loaders, (list, tuple)):
        return [item for value in loaders for item in _flat(value)]
    if isinstance(loaders, dict):
        return [item for value in loaders.values() for item in _flat(value)]
    return [] if loaders is None else [loaders]


def _is_resumable(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def rng_states() -> dict[str, Any]:
    """The global random states of torch (CPU and every CUDA device), numpy and Python, as plain tensors, lists and
    ints (so a checkpoint holding them loads with ``torch.load(weights_only=True)``)."""
    numpy_state = np.random.get_state(legacy=True)
    assert isinstance(numpy_state, tuple)  # the global generator is numpy's MT19937: its legacy state, a tuple
    kind, keys, position, has_gauss, gauss = numpy_state
    version, state, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, keys.tolist(), int(position), int(has_gauss), float(gauss)],
        "python": [version, list(state), python_gauss],
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what :func:`rng_states` returned (CUDA states only where the devices are there)."""
    torch.set_rng_state(states["torch"])
    if states.get("cuda") and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, keys, position, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, gauss))
    version, state, python_gauss = states["python"]
    random.setstate((version, tuple(state), python_gauss))
