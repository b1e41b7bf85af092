"""Deterministic train/val/test splits and size checks shared by the sample data modules."""

from __future__ import annotations

from collections.abc import Mapping, Sized
from typing import Any, Callable, Optional, Union, cast

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_mp.samples.data._resumable import EpochShuffleSampler, ResumableBatchSampler, ResumableDataLoader

#: Test fraction of the pool when a source has no official test split and ``test_size`` is not given.
DEFAULT_TEST_FRACTION = 0.2


def check_split_args(train_size: Any, val_size: Any, test_size: Any) -> None:
    """Raise ``ValueError`` naming the bad value unless the sizes are valid (see :func:`split_indices`)."""
    for name, value in (("train_size", train_size), ("test_size", test_size)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is not allowed: use None (everything available) or an int >= 1.")
    is_int = isinstance(val_size, int) and not isinstance(val_size, bool)
    is_fraction = isinstance(val_size, float) and 0.0 < val_size < 1.0
    if not ((is_int and val_size >= 1) or is_fraction):
        raise ValueError(
            f"val_size={val_size!r} is not allowed: use an int >= 1 (number of examples) or a float in (0, 1) "
            "(fraction of the training pool)."
        )


def check_int(name: str, value: Any, low: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is not allowed: use an int >= {low}.")


def split_indices(
    n_pool: int,
    *,
    n_test_pool: Optional[int] = None,
    train_size: Optional[int] = None,
    val_size: Union[int, float] = 0.1,
    test_size: Optional[int] = None,
    seed: int = 0,
) -> dict[str, Tensor]:
    """Deterministic ``train``/``val``/``test`` index tensors drawn with ``torch.Generator().manual_seed(seed)``.

    Without an official test split (``n_test_pool=None``) one permutation of the pool gives, in order, the test
    set (``test_size``, default 20% of the pool), the validation set and the training set. With one, ``test``
    indexes the official test split (all of it, or a random ``test_size`` subset) and ``val``/``train`` come out
    of the pool. ``val_size`` is a count or a fraction of the training pool (everything that is not test);
    ``train_size`` defaults to everything left. Growing ``train_size`` keeps the same val and test sets.

    Raises:
        ValueError: a size larger than what is available (the message says how many are).
    """
    generator = torch.Generator().manual_seed(seed)
    rest = torch.randperm(n_pool, generator=generator)
    if n_test_pool is None:
        n_test = round(DEFAULT_TEST_FRACTION * n_pool) if test_size is None else test_size
        _check_available("test_size", n_test, n_pool - 1, f"of the pool of {n_pool} (one must remain for training)")
        test, rest = rest[:n_test], rest[n_test:]
    elif test_size is None:
        test = torch.arange(n_test_pool)
    else:
        _check_available("test_size", test_size, n_test_pool, "in the test split")
        test = torch.randperm(n_test_pool, generator=generator)[:test_size]
    n_val = val_size if isinstance(val_size, int) else max(1, round(val_size * len(rest)))
    _check_available("val_size", n_val, len(rest) - 1, f"of the training pool of {len(rest)} (one must remain)")
    val, rest = rest[:n_val], rest[n_val:]
    n_train = len(rest) if train_size is None else train_size
    _check_available("train_size", n_train, len(rest), f"for training (after {len(test)} test, {n_val} val)")
    return {"train": rest[:n_train], "val": val, "test": test}


def _check_available(name: str, wanted: int, available: int, where: str) -> None:
    if wanted > available:
        raise ValueError(f"{name}={wanted} is too large: only {max(available, 0)} examples are available {where}.")


class SplitDataModule(L.LightningDataModule):
    """Loaders shared by the sample data modules: ``setup`` fills ``self._datasets`` with ``train``/``val``/
    ``test`` datasets; training batches are shuffled in an order drawn from ``self.seed`` and the epoch, and a run
    resumed from a checkpoint sees the batches the uninterrupted run would have seen; predict uses test."""

    _STAGES = {"train": "fit", "val": "validate", "test": "test"}
    seed: int
    batch_size: int
    num_workers: int

    def __init__(self) -> None:
        super().__init__()
        # each data module fills it with its own datasets (a subclass narrows the type)
        self._datasets: Mapping[str, Dataset] = {}

    @property
    def collate_fn(self) -> Optional[Callable[[list[Any]], Any]]:
        """The loaders' collate function (``None``: torch's default)."""
        return None

    def _loader(self, split: str, shuffle: bool = False) -> DataLoader:
        if split not in self._datasets:
            self.setup(self._STAGES[split])
        dataset = self._datasets[split]
        # Each loader has its own generator: iterating a DataLoader draws a worker seed from its generator, or from
        # the global RNG without one, which would change the random stream (dropout) the model sees after a resume.
        generator = torch.Generator().manual_seed(self.seed)
        if not shuffle:
            return DataLoader(
                dataset,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                collate_fn=self.collate_fn,
                generator=generator,
            )
        sampler = EpochShuffleSampler(cast(Sized, dataset), seed=self.seed)  # the sample datasets are map-style: sized
        batches = ResumableBatchSampler(sampler, self.batch_size, drop_last=False)
        return ResumableDataLoader(
            dataset,
            batch_sampler=batches,
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
            generator=generator,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches: epoch ``e`` in the order drawn from ``seed + e``; resumable mid-epoch."""
        return self._loader("train", shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._loader("test")
