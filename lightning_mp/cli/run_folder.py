"""A run that stops with an error before writing anything leaves no folder behind.

Lightning's logger creates the run's folder (``<default_root_dir>/lightning_logs/version_N``) as the Trainer sets up,
before the data module's ``setup``: a run refused there (a missing data file, a missing package) left an empty
``version_N`` (and the folders above it), and the next run counted it and went to ``version_N+1``.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback


class NoEmptyRunFolder(Callback):
    """When ``fit`` (or ``validate``, ``test``, ``predict``) ends with an error, removes each folder of the run's
    loggers that did not exist when the Trainer was built and is still empty: the log folder and the folders above it
    that it created. A folder that holds anything (a report, a checkpoint, a metrics file) is kept whole, and so is
    every folder that was there before."""

    def __init__(self) -> None:
        self.created: list[Path] = []  # deepest first

    def watch(self, trainer: L.Trainer) -> None:
        """Note the folders the loggers of ``trainer`` will create (call it once the Trainer is built, before it runs:
        the loggers create their folders as it sets up)."""
        self.created = []
        for logger in trainer.loggers:
            folder = getattr(logger, "log_dir", None)
            path = Path(folder).absolute() if folder else None
            while path is not None and not path.exists() and path != path.parent:
                if path not in self.created:
                    self.created.append(path)
                path = path.parent
        self.created.sort(key=lambda path: len(path.parts), reverse=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        for path in self.created:
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
