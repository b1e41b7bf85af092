"""``ImageDataModule``: small 10-class grayscale image sets that need no download at run time.

``digits`` ships with scikit-learn; MNIST and Fashion-MNIST are read from the four IDX files in a folder
(plain or ``.gz``; Debian's ``dataset-fashion-mnist`` package installs Fashion-MNIST's in
``/usr/share/datasets/fashion-mnist``). Splits are drawn deterministically from ``seed``; images are standardised
with the mean/std of the training split.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from lightning_mp.samples.data._split import SplitDataModule, check_int, check_split_args, split_indices
from lightning_mp.samples.resources import (
    FASHION_MNIST_DIR,
    SourceUnavailableError,
    check_sample_dependency,
    import_sample_dependency,
)

SOURCES = ("digits", "mnist", "fashion_mnist")
IDX_IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
IDX_LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
#: (images, labels) file stems per split, as published (each may also end in ``.gz``).
IDX_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
_HOW_TO_GET = {
    "fashion_mnist": (
        f"run `apt-get install dataset-fashion-mnist` (installs them into {FASHION_MNIST_DIR}), or download the "
        "four IDX files from https://github.com/zalandoresearch/fashion-mnist into a folder and pass path="
    ),
    "mnist": (
        "download the four IDX files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
        f"t10k-labels-idx1-ubyte; .gz or not) from {MNIST_URL} into a folder and pass path="
    ),
}


def read_idx(path: Union[str, Path], magic: int) -> np.ndarray:
    """The uint8 array in an IDX file (``.gz`` is decompressed); ``magic`` is the expected magic number.

    The header is the big-endian int32 magic number (``0x00000803`` images, ``0x00000801`` labels) followed by
    one big-endian int32 per dimension.

    Raises:
        ValueError: naming the file, when the magic number or the size does not match.
    """
    path = Path(path)
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    found = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if found != magic:
        shown = "none (file shorter than 4 bytes)" if found is None else f"0x{found:08x}"
        raise ValueError(f"{path}: not an IDX file of the expected kind: magic number {shown}, expected 0x{magic:08x}.")
    n_dims = magic & 0xFF
    header = 4 + 4 * n_dims
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header}).")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">i4", count=n_dims, offset=4))
    size, data = int(np.prod(shape)), len(raw) - header
    if data != size:
        raise ValueError(f"{path}: the header says shape {shape} ({size} bytes of data), the file has {data}.")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def find_idx_file(folder: Path, stem: str) -> Optional[Path]:
    """``folder/stem`` or ``folder/stem.gz`` (also the ``train-images.idx3-ubyte`` spelling), or None."""
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, f"{stem}.gz", dotted, f"{dotted}.gz"):
        if (folder / name).is_file():
            return folder / name
    return None


def locate_idx_files(folder: Union[str, Path], source: str = "mnist") -> dict[str, tuple[Path, Path]]:
    """``{"train": (images file, labels file), "test": ...}`` found in ``folder``.

    Raises:
        SourceUnavailableError: the folder or one of the files is missing (the message says how to get them).
    """
    folder = Path(folder).expanduser()
    how = _HOW_TO_GET.get(source, _HOW_TO_GET["mnist"])
    if not folder.is_dir():
        raise SourceUnavailableError(f"source={source!r}: folder {str(folder)!r} does not exist; {how}.")
    found: dict[str, tuple[Path, Path]] = {}
    for split, (images_stem, labels_stem) in IDX_FILES.items():
        images, labels = find_idx_file(folder, images_stem), find_idx_file(folder, labels_stem)
        for stem, file in ((images_stem, images), (labels_stem, labels)):
            if file is None:
                raise SourceUnavailableError(f"source={source!r}: {stem}[.gz] is missing from {str(folder)!r}; {how}.")
        assert images is not None and labels is not None  # (both found: checked above)
        found[split] = (images, labels)
    return found


def read_idx_folder(folder: Union[str, Path], source: str = "mnist") -> dict[str, tuple[Tensor, Tensor]]:
    """``{"train": (images, labels), "test": ...}``: images (N, 1, 28, 28) float32 in [0, 1], labels int64.

    Raises:
        SourceUnavailableError: the folder or a file is missing (see :func:`locate_idx_files`).
        ValueError: a file is not a valid IDX file, or images and labels disagree in number.
    """
    splits = {}
    for split, (images_file, labels_file) in locate_idx_files(folder, source).items():
        images, labels = read_idx(images_file, IDX_IMAGES_MAGIC), read_idx(labels_file, IDX_LABELS_MAGIC)
        if len(images) != len(labels):
            raise ValueError(f"{images_file} holds {len(images)} images but {labels_file} holds {len(labels)} labels.")
        pixels = torch.from_numpy(images.copy()).unsqueeze(1).float().div_(255.0)
        splits[split] = (pixels, torch.from_numpy(labels.astype(np.int64)))
    return splits


#: what ``source="digits"`` needs: the package on the index, and what the message says needs it
_DIGITS_NEED = ("scikit-learn", "source='digits' (scikit-learn's 8x8 digits)")


def load_digits() -> tuple[Tensor, Tensor]:
    """scikit-learn's 1,797 8x8 digits: images (N, 1, 8, 8) float32 scaled from 0..16 to [0, 1], labels int64."""
    datasets = import_sample_dependency("sklearn.datasets", *_DIGITS_NEED)
    digits = datasets.load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    return images, torch.as_tensor(digits.target, dtype=torch.int64)


class ImageDataModule(SplitDataModule):
    """10-class grayscale images as ``(images, labels)`` batches: float32 (B, 1, H, W) and int64 (B,).

    Args:
        source: ``"digits"`` (default; scikit-learn's 1,797 8x8 digits, no download), ``"mnist"`` or
            ``"fashion_mnist"`` (28x28, from the four IDX files, plain or ``.gz``).
        path: folder with the IDX files. Required for ``mnist``; ``fashion_mnist`` defaults to
            ``/usr/share/datasets/fashion-mnist`` (Debian package ``dataset-fashion-mnist``). Unused by digits.
        train_size: training examples (default None: all that remain after test and val).
        val_size: validation examples, an int, or a float in (0, 1) for that fraction of the training pool
            (everything that is not test). Default 0.1.
        test_size: test examples (default None: the whole official test split of mnist/fashion_mnist; 20% of
            the 1,797 for digits, which has no test split).
        batch_size: images per batch (default 64).
        normalize: standardise pixels with the training split's mean and std (default True); otherwise pixels
            stay in [0, 1].
        seed: seed of the split/subset draw and of the training shuffle (default 0).
        num_workers: DataLoader worker processes (default 0).

    ``num_classes`` (10), ``in_channels`` (1) and ``image_size`` (8 or 28) describe the data for the model;
    after ``setup``, ``sizes`` holds the number of examples per split and ``mean``/``std`` the statistics used.
    """

    num_classes = 10
    in_channels = 1

    def __init__(
        self,
        source: str = "digits",
        path: Optional[str] = None,
        train_size: Optional[int] = None,
        val_size: Union[int, float] = 0.1,
        test_size: Optional[int] = None,
        batch_size: int = 64,
        normalize: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"source={source!r} is not supported: use one of {list(SOURCES)}.")
        if source == "digits" and path is not None:
            raise ValueError(f"path={path!r} is not used by source='digits' (it ships with scikit-learn).")
        if source == "mnist" and not path:
            raise ValueError(f"source='mnist' needs path=: {_HOW_TO_GET['mnist']}.")
        check_split_args(train_size, val_size, test_size)
        check_int("batch_size", batch_size, 1)
        check_int("num_workers", num_workers, 0)
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize={normalize!r} is not allowed: use True or False.")
        self.check_dependencies(source)
        self.save_hyperparameters()
        self.source = source
        self.path = Path(path).expanduser() if path else FASHION_MNIST_DIR if source == "fashion_mnist" else None
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.batch_size, self.normalize, self.seed, self.num_workers = batch_size, normalize, seed, num_workers
        self.image_size = 8 if source == "digits" else 28
        self.sizes: dict[str, int] = {}
        self.mean: Optional[float] = None
        self.std: Optional[float] = None
        self._datasets: dict[str, TensorDataset] = {}

    @staticmethod
    def check_dependencies(source: str = "digits", **_: Any) -> None:
        """Raise :class:`~lightning_mp.samples.resources.MissingExtraError` when what ``source`` needs is not
        installed (digits: scikit-learn, of the ``samples`` extra); the other arguments are not used. The command line
        calls it with the config's arguments before any work, the constructor with its own."""
        if source == "digits":
            check_sample_dependency("sklearn", *_DIGITS_NEED)

    def prepare_data(self) -> None:
        """Check that the IDX files are there (nothing is downloaded)."""
        if self.path is not None:
            locate_idx_files(self.path, self.source)

    def setup(self, stage: Optional[str] = None) -> None:
        """Load, split and standardise all splits (once; the data sets are small)."""
        if self._datasets:
            return
        if self.source == "digits":
            pool, test_pool = load_digits(), None
        else:
            assert self.path is not None  # mnist needs path= (checked in __init__), fashion_mnist has a default
            loaded = read_idx_folder(self.path, self.source)
            pool, test_pool = loaded["train"], loaded["test"]
        indices = split_indices(
            len(pool[1]),
            n_test_pool=None if test_pool is None else len(test_pool[1]),
            train_size=self.train_size,
            val_size=self.val_size,
            test_size=self.test_size,
            seed=self.seed,
        )
        splits = {
            split: tuple(t[idx] for t in (test_pool if split == "test" and test_pool is not None else pool))
            for split, idx in indices.items()
        }
        if self.normalize:
            train_images = splits["train"][0]
            self.mean, self.std = train_images.mean().item(), train_images.std().item()
            scale = self.std if self.std > 0 else 1.0
            splits = {split: ((x - self.mean) / scale, y) for split, (x, y) in splits.items()}
        self._datasets = {split: TensorDataset(*tensors) for split, tensors in splits.items()}
        self.sizes = {split: len(dataset) for split, dataset in self._datasets.items()}
