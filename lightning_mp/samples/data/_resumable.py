"""Training batches in an order that a resumed run continues: an epoch-aware shuffle and a loader that knows its
position in the epoch.

Lightning calls ``set_epoch(epoch)`` on a loader's sampler at the start of every training epoch, and saves a
training loader's ``state_dict()`` in every checkpoint when the loader has one (restoring it with
``load_state_dict`` before the first batch of a resumed run). :class:`EpochShuffleSampler` draws epoch ``e``'s
order from ``seed + e`` (as ``DistributedSampler`` does), so every epoch after a resume has the order the
uninterrupted run had; :class:`ResumableDataLoader` records how many batches of the epoch it delivered, so a run
resumed from a mid-epoch checkpoint continues with the next batch instead of replaying the epoch's first ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler


class EpochShuffleSampler(RandomSampler):
    """A permutation of ``range(len(data_source))`` drawn with ``torch.Generator().manual_seed(seed + epoch)``.

    Args:
        data_source: the dataset (only its length is used).
        seed: base seed of the order (default 0).

    ``set_epoch(epoch)`` (called by Lightning at each epoch start) picks the epoch. It is a ``RandomSampler``, so
    Lightning treats the loader as shuffled: under DDP it puts a ``DistributedSampler(shuffle=True)`` in its place,
    which is epoch-aware the same way.
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class ResumableBatchSampler(BatchSampler):
    """``BatchSampler`` whose iterations leave out their first ``skip`` batches (default 0: none).

    The skipped batches are index lists only: no example is loaded for them. Same arguments as ``BatchSampler``
    (Lightning re-creates it around a ``DistributedSampler`` under DDP).
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.skip = 0

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(super().__iter__(), self.skip, None)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` (with a :class:`ResumableBatchSampler`) whose position in the epoch goes into checkpoints.

    ``state_dict()`` is ``{"epoch": <sampler epoch>, "batches": <batches delivered this epoch>}``. After
    ``load_state_dict``, the next iteration starts after those batches if it is that epoch (the sampler's
    ``epoch`` attribute, set by Lightning); a state saved after an epoch's last batch does not empty the next
    epoch. Same arguments as ``DataLoader``; ``batch_sampler`` must be a :class:`ResumableBatchSampler`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.batch_sampler, ResumableBatchSampler):
            raise TypeError(
                f"ResumableDataLoader needs batch_sampler=ResumableBatchSampler(...), got {self.batch_sampler!r}."
            )
        self._delivered = 0
        self._resume: Optional[tuple[int, int]] = None

    def _resumable(self) -> ResumableBatchSampler:
        batch_sampler = self.batch_sampler
        assert isinstance(batch_sampler, ResumableBatchSampler)  # (checked in __init__)
        return batch_sampler

    def _epoch(self) -> int:
        return int(getattr(self._resumable().sampler, "epoch", 0))

    # a generator over DataLoader's own iterator, where DataLoader declares its iterator class
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: nothing runs before the first batch is asked for, i.e. after Lightning's set_epoch().
        resume, self._resume = self._resume, None
        skip = resume[1] if resume is not None and resume[0] == self._epoch() and resume[1] < len(self) else 0
        batch_sampler = self._resumable()
        batch_sampler.skip = skip
        try:
            batches = super().__iter__()  # reads the batch sampler now (workers prefetch from it)
        finally:
            batch_sampler.skip = 0
        self._delivered = skip
        for batch in batches:
            self._delivered += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Where the loader is: the sampler's epoch and how many of its batches were delivered."""
        return {"epoch": self._epoch(), "batches": self._delivered}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue after ``state_dict["batches"]`` batches if the next iteration is epoch ``state_dict["epoch"]``."""
        self._resume = (int(state_dict["epoch"]), int(state_dict["batches"]))
