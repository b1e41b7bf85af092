"""What a precision plugin with master weights offers the code around it, over its ``masters`` (``None`` without
master weights): the masters follow writes into the model, and code that reads or writes weights during fit (an EMA
teacher, weight averaging) gets the exact fp32 values. A mixin, so that the Trainer's and Fabric's faces of the
plugin (and its subclasses) share one definition of each."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

from torch import Tensor
from torch.nn import Module

from lightning_mp.master import exact
from lightning_mp.master.model_sync import follow_writes, start_following


class MasterWeightsAccess:
    """The master-weights methods of :class:`~lightning_mp.MixedPrecisionPlugin`."""

    masters: Optional[Any]

    def start_following_writes(self, model: Optional[Module] = None) -> None:
        """Setup is over: from now on every write into ``model`` reaches the masters (:meth:`follow_model_writes`)."""
        start_following(self.masters, model)

    def follow_model_writes(self) -> None:
        """Make the master weights follow every write into the model since the plugin's last step (a load into
        any submodule, ``nn.init``, ``copy_`` under ``no_grad``, ``p.data = t``, a replaced parameter), or raise
        :class:`~lightning_mp.master.model_sync.ModelWriteError` naming a parameter they cannot follow. Runs before
        each optimizer step, each save and at teardown (see docs/master-weights.md, "Writes after setup")."""
        follow_writes(self.masters)

    def exact_weights(self, module: Module, write: bool = True) -> contextlib.AbstractContextManager[Module]:
        """A context inside which ``module.parameters()`` are fp32 parameters holding the exact master values, and
        what is written into them becomes the masters on leaving (``write=False``: read only). ``module``: the model
        or any module of it (``self.unet``); one these masters do not hold raises
        :class:`~lightning_mp.master.exact.NotHeldError`; without master weights the parameters are given as they
        are (they are the exact weights). See :func:`lightning_mp.master.exact_weights` and docs/master-weights.md,
        "Weight averaging and EMA teachers"."""
        return exact.exact_weights(module, store=self.masters, write=write)

    def exact_parameters(self, module: Module) -> Iterator[tuple[str, Tensor]]:
        """``(name, exact fp32 value)`` per parameter of ``module`` (the model or any module of it), one at a time (the
        master itself with ``master_weights=True``, a joined fp32 tensor with ``"remainder"``; without master weights
        the parameters as they are): :func:`lightning_mp.master.exact_parameters`."""
        return exact.exact_parameters(module, store=self.masters)
