"""What the lean update reads of its store: :class:`LeanStore`, a Protocol.

The update (:mod:`.update`: the one-pass plans of :mod:`.plan`, the chunked path of :mod:`.chunked`, the generic path
of :mod:`.generic`) and the step inside backward work on any store that offers these members:
:class:`~lightning_mp.master.lean.store.RemainderMasters` and FSDP2's sharded store
(:mod:`lightning_mp.distributed.fsdp2_lean`). A Protocol, not a base class, so that the update does not import the
store that imports it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from torch import Tensor

from lightning_mp.kernels.bits import JoinSplit


class LeanStore(Protocol):
    """A store of lean masters: bf16 weights and int16 remainders in flat blocks, as the update reads them."""

    #: the join and split of the chunked and generic paths
    codec: JoinSplit
    #: the one-pass update's step plans by the id of their group or parameter (:class:`~.plan.Plans`)
    step_plans: dict[int, Any]
    #: each optimizer's update (:class:`~.update.Updates`)
    updates: Any
    #: the generic path's step of an optimizer the table does not know (a class: ``generic_step(optimizer, store,
    #: chunk_size)``; :class:`~.generic.GenericChunkedStep`, FSDP2's sharded one)
    generic_step: type[Any]
    #: the step of torchao's ``AdamW8bit`` / ``Adam8bit`` (``eight_bit_step(optimizer, store, chunk_size)``:
    #: :class:`~.eightbit.Adam8bitStep`), or ``None``: the generic path runs them (FSDP2's store)
    eight_bit_step: Optional[type[Any]]

    @property
    def layout_version(self) -> int:
        """Changes whenever blocks are made or released (the plans' addresses are then stale)."""
        ...

    def offset_of(self, param: Tensor) -> Optional[int]:
        """Where ``param`` starts in its device's flat buffers; ``None`` for a parameter without remainder."""
        ...

    def flat_slices(self, device: torch.device, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Elements ``[start, end)`` of the flat bf16 weights and int16 remainders."""
        ...

    def chunk_size_for(self, device: torch.device) -> int:
        """The chunked path's chunk size on ``device``."""
        ...

    def check_trained(self, params: list[Tensor]) -> None:
        """Raise for a parameter put in a group that the store does not hold (a plan asks when it lays out)."""
        ...
