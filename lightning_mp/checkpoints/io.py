"""Checkpoints that hold tensor subclasses (torchao's 8-bit optimizer state), loaded through Lightning.

Lightning's ``TorchCheckpointIO`` loads every checkpoint with ``map_location=lambda storage, loc: storage`` (every
storage on the CPU), and torch refuses a callable ``map_location`` for a wrapper tensor subclass: a Trainer resume
(``trainer.fit(ckpt_path=...)``) or a ``fabric.load`` of torchao's ``AdamW8bit`` state fails with ``RuntimeError:
Callable map_location not supported with _rebuild_wrapper_subclass``, with or without the plugin.
:class:`TensorSubclassCheckpointIO` is Lightning's own checkpoint IO with ``map_location="cpu"`` in place of that
callable: the same placement (every storage on the CPU; the strategy moves the state to its device, as before), and
torch loads the subclasses. A ``map_location`` a caller passes is kept. Pass it with the plugin::

    Trainer(plugins=[MixedPrecisionPlugin(...), TensorSubclassCheckpointIO()])
    Fabric(plugins=[MixedPrecisionPlugin(...), TensorSubclassCheckpointIO()])

(``lightning_mp.pytorch_lightning`` has the same class for the standalone ``pytorch_lightning`` package.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_warn

#: what torch says where a callable ``map_location`` meets a tensor subclass (the Fabric driver names the fix)
REFUSAL = "Callable map_location not supported with _rebuild_wrapper_subclass"


class CPUMapLocation:
    """The load with ``map_location="cpu"`` where none is passed (a base for either Lightning package's
    ``TorchCheckpointIO``)."""

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Any:
        return super().load_checkpoint(  # type: ignore[misc]
            path, map_location="cpu" if map_location is None else map_location, weights_only=weights_only
        )


class TensorSubclassCheckpointIO(CPUMapLocation, TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, loading tensor subclasses (module doc)."""


def warn_if_unloadable(strategy: Any, optimizers: Sequence[Any]) -> None:
    """At connect: where an optimizer is one of torchao's (its state holds tensor subclasses: 8-bit, 4-bit, fp8) and
    the strategy's checkpoints go through Lightning's own ``TorchCheckpointIO``, a warning that they will not load
    back and what to pass, before the first checkpoint is written (a resume finds out only when it loads). Strategies
    that save distributed checkpoints do not load through it and are left alone."""
    if strategy is None or getattr(strategy, "_save_distributed_checkpoint", False):
        return
    try:
        io = getattr(strategy, "checkpoint_io", None)
    except NotImplementedError:  # Fabric's FSDP and ModelParallel strategies: no CheckpointIO interface at all
        return
    if type(io).__name__ != "TorchCheckpointIO":  # a subclass (this module's among them) or another IO: the user's
        return
    torchao = sorted({type(o).__name__ for o in optimizers if type(o).__module__.startswith("torchao.optim")})
    if torchao:
        rank_zero_warn(
            f"{', '.join(torchao)} keeps its state in tensor subclasses, which Lightning's own TorchCheckpointIO "
            "cannot load back (torch refuses its callable map_location for them): a resume from this run's "
            "checkpoints would fail. Pass lightning_mp.TensorSubclassCheckpointIO() next to the plugin "
            "(Trainer(plugins=[...]) or Fabric(plugins=[...])): the same checkpoints, loadable."
        )


__all__ = ["REFUSAL", "TensorSubclassCheckpointIO", "warn_if_unloadable"]
