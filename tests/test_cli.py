"""`python -m lightning_mp`: precision mapping, configs end to end (shortened), re-runs, logged metrics.

The messages a user meets (refused options, fallbacks, --print_config, refused checkpoints, the end-of-fit
summary) are in tests/test_cli_messages.py; the kill -9 and resume test is in tests/test_cli_resume.py.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lightning_mp.cli.app as cli
import lightning_mp.cli.choice as choice
from lightning_mp import MixedPrecisionPlugin
from lightning_mp.cli import main, plugin_for
from lightning_mp.cli.checks import CLIConfigError

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TINY_BERT = (
    "--model.init_args.pretrained=false",
    "--model.init_args.config_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, "
    "intermediate_size: 64}",
)


def _short(tmp_path, *extra, steps=2):
    return [
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.log_every_n_steps=1",
        *extra,
    ]


def _metrics(tmp_path):
    files = sorted(Path(tmp_path).rglob("metrics.csv"))
    assert files, f"no metrics.csv under {tmp_path}"
    with files[-1].open() as handle:
        return list(csv.DictReader(handle))


# ---------------------------------------------------------------------- trainer.precision -> plugin
def test_mixed_precision_flags_build_our_plugin_on_gpu(monkeypatch):
    monkeypatch.setattr(choice, "_runs_on_cpu", lambda accelerator: False)
    plugin = plugin_for("16-mixed", "gpu", None, {"master_weights": True, "scaler": {"init_scale": 1024.0}})
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.precision == "16-mixed"
    assert plugin.master_weights and plugin.scaler.scale == 1024.0
    assert plugin_for("bf16-mixed", "gpu", None, {}).precision == "bf16-mixed"
    assert plugin_for("32-true", "gpu", None, {"master_weights": True}) is None
    assert plugin_for(None, "gpu", None, {}) is None


@pytest.mark.parametrize("native_bf16, expected", [(True, "bf16-mixed"), (False, None)])
def test_16_mixed_on_cpu_falls_back_with_a_warning(monkeypatch, native_bf16, expected):
    monkeypatch.setattr(choice, "cpu_has_native_bf16", lambda: native_bf16)
    with pytest.warns(UserWarning, match="without a GPU"):
        plugin = plugin_for("16-mixed", "cpu", None, {"scaler": {"init_scale": 8.0}})
    assert (plugin.precision if plugin else None) == expected
    if plugin is not None:
        assert plugin.scaler.check_only  # bf16: the fp16 scaler settings do not apply; only the inf/NaN check


def test_precision_flag_and_precision_plugin_together_are_refused():
    with pytest.raises(CLIConfigError, match="MixedPrecisionPlugin.*both|both.*MixedPrecisionPlugin"):
        plugin_for("bf16-mixed", "cpu", [MixedPrecisionPlugin("bf16-mixed")], {})


def test_cli_refuses_conflicting_flags(tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "fit",
                "--config",
                str(CONFIGS / "digits.yaml"),
                *_short(tmp_path),
                "--trainer.precision=bf16-mixed",
                "--trainer.plugins=lightning_mp.MixedPrecisionPlugin",
                "--trainer.plugins.precision=bf16-mixed",
            ]
        )
    assert exited.value.code == 2
    assert "Drop trainer.precision" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.ckpt"))


# ---------------------------------------------------------------------- configs, shortened
def test_digits_config_trains_tests_and_logs_lr(tmp_path):
    main(["fit", "--config", str(CONFIGS / "digits.yaml"), *_short(tmp_path, steps=3)])
    rows = _metrics(tmp_path)
    assert any(row.get("lr") for row in rows)
    assert any(row.get("test_acc") for row in rows)


def test_digits_config_logs_a_training_curve_within_each_epoch():
    from lightning_mp.samples.data import ImageDataModule

    config = yaml.safe_load((CONFIGS / "digits.yaml").read_text())
    data = ImageDataModule(**config["data"]["init_args"])
    data.setup("fit")
    batches_per_epoch = len(data.train_dataloader())
    assert config["trainer"]["log_every_n_steps"] * 3 <= batches_per_epoch  # >= 3 points per epoch


@pytest.mark.parametrize("config", ["digits.yaml", "bert.yaml", "bert-imdb.yaml", "resnet18-mnist.yaml"])
def test_every_config_keeps_a_true_last_checkpoint(config):
    callbacks = yaml.safe_load((CONFIGS / config).read_text())["trainer"]["callbacks"]
    last = [cb for cb in callbacks if cb["class_path"] == "lightning_mp.cli.checkpoints.LastCheckpoint"]
    assert len(last) == 1
    assert not any((cb.get("init_args") or {}).get("save_last") for cb in callbacks)  # Lightning's best-copy last.ckpt
    if config != "digits.yaml":  # runs of more than a few minutes also write it every N steps
        assert last[0]["init_args"]["every_n_train_steps"] > 0


def test_explicit_fp16_plugin_logs_loss_scale_and_skipped_steps(tmp_path):
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "digits.yaml"),
            *_short(tmp_path, steps=3),
            "--trainer.precision=null",
            "--trainer.plugins=lightning_mp.MixedPrecisionPlugin",
            "--trainer.plugins.precision=16-mixed",
            "--trainer.plugins.scaler={init_scale: 1024.0}",
        ]
    )
    rows = [row for row in _metrics(tmp_path) if row.get("loss_scale")]
    assert rows and float(rows[-1]["loss_scale"]) == 1024.0
    assert float(rows[-1]["skipped_steps"]) == 0.0


def test_mixed_precision_section_reaches_the_plugin(tmp_path, monkeypatch):
    monkeypatch.setattr(choice, "_runs_on_cpu", lambda accelerator: False)  # 16-mixed as on a GPU, run on CPU
    seen = {}
    original = cli.MixedPrecisionCLI._instantiate_trainer

    def spy(self, config, callbacks):
        trainer = original(self, config, callbacks)
        seen["plugin"] = trainer.precision_plugin
        return trainer

    monkeypatch.setattr(cli.MixedPrecisionCLI, "_instantiate_trainer", spy)
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "digits.yaml"),
            *_short(tmp_path, steps=1),
            "--trainer.accelerator=cpu",
            "--mixed_precision.master_weights=true",
            "--mixed_precision.scaler={init_scale: 256.0, hysteresis: 2}",
        ]
    )
    plugin = seen["plugin"]
    assert isinstance(plugin, MixedPrecisionPlugin) and plugin.precision == "16-mixed" and plugin.master_weights
    assert plugin.scaler.hysteresis == 2 and plugin.scaler.steps == 1


def test_rerun_in_the_same_directory_works(tmp_path):
    for _ in range(2):
        main(["fit", "--config", str(CONFIGS / "digits.yaml"), *_short(tmp_path, steps=1), "--test_after_fit=false"])
    assert (tmp_path / "lightning_logs").exists() or list(tmp_path.rglob("config.yaml"))


def test_bert_config_with_a_tiny_bert(tmp_path):
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "bert.yaml"),
            *_short(tmp_path),
            *TINY_BERT,
            "--data.init_args.train_size=16",
            "--data.init_args.val_size=16",
            "--data.init_args.test_size=16",
            "--data.init_args.batch_size=8",
        ]
    )
    rows = _metrics(tmp_path)
    assert any(row.get("test_acc") for row in rows) and any(row.get("val_f1") for row in rows)


def test_bert_imdb_config_on_an_aclimdb_folder(tmp_path):
    folder = tmp_path / "aclImdb"
    for split in ("train", "test"):
        for label, words in (("pos", "great wonderful film"), ("neg", "dull awful mess")):
            (folder / split / label).mkdir(parents=True)
            for i in range(6):
                (folder / split / label / f"{i}_7.txt").write_text(f"{words} number {i}")
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "bert-imdb.yaml"),
            *_short(tmp_path / "run"),
            *TINY_BERT,
            "--model.init_args.model_name_or_path=minilm",
            "--data.init_args.tokenizer=minilm",
            f"--data.init_args.path={folder}",
            "--data.init_args.train_size=8",
            "--data.init_args.val_size=2",
            "--data.init_args.test_size=4",
            "--data.init_args.batch_size=4",
            "--data.init_args.max_length=16",
        ]
    )
    assert any(row.get("test_acc") for row in _metrics(tmp_path / "run"))


def test_bert_imdb_config_offline_fails_at_start_with_instructions(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: no network retries
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", str(CONFIGS / "bert-imdb.yaml"), *_short(tmp_path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "lightning_mp: error: model 'bert-base-cased' could not be loaded" in err
    assert "--model.init_args.model_name_or_path" in err and "Traceback" not in err
    assert not list(tmp_path.rglob("*.ckpt"))  # failed before any training


def test_resnet18_mnist_config_on_idx_files(tmp_path):
    import gzip
    import struct

    folder = tmp_path / "mnist"
    folder.mkdir()
    gen = torch.Generator().manual_seed(0)
    for prefix, count in (("train", 40), ("t10k", 16)):
        images = torch.randint(0, 256, (count, 28, 28), generator=gen, dtype=torch.uint8)
        labels = torch.randint(0, 10, (count,), generator=gen, dtype=torch.uint8)
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as handle:
            handle.write(struct.pack(">IIII", 0x803, count, 28, 28) + images.numpy().tobytes())
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as handle:
            handle.write(struct.pack(">II", 0x801, count) + labels.numpy().tobytes())
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "resnet18-mnist.yaml"),
            *_short(tmp_path / "run"),
            f"--data.init_args.path={folder}",
            "--data.init_args.val_size=8",
            "--data.init_args.batch_size=8",
            "--model.init_args.width=8",
        ]
    )
    assert any(row.get("test_acc") for row in _metrics(tmp_path / "run"))


def test_python_dash_m_entry_point_runs_without_the_args_warning_and_ends_with_the_summary(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_mp",
            "fit",
            "--config",
            str(CONFIGS / "digits.yaml"),
            *_short(tmp_path, steps=1),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LightningCLI's args parameter" not in done.stderr
    summary = next(line for line in done.stderr.splitlines() if line.startswith("lightning_mp: fit ran"))
    assert "fit ran 1 optimizer steps" in summary and "last.ckpt" in summary and "metrics.csv" in summary


def test_any_lightning_module_by_class_path(tmp_path):
    main(
        [
            "fit",
            "--config",
            str(CONFIGS / "digits.yaml"),
            *_short(tmp_path, steps=2),
            "--model=tests.helpers.DigitsMLP",
            "--model.hidden=16",
            "--test_after_fit=false",
        ]
    )
    assert list(tmp_path.rglob("*.ckpt"))


def test_precision_monitor_puts_scale_and_skips_in_the_progress_bar(tmp_path):
    from lightning_mp import DynamicLossScaler, PrecisionMonitor
    from tests.helpers import TinyRegressor, make_trainer, regression_loader

    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    trainer = make_trainer(plugin, callbacks=[PrecisionMonitor()], max_steps=4, default_root_dir=tmp_path)
    trainer.fit(TinyRegressor(inject_inf_at=[1]), regression_loader())
    assert trainer.progress_bar_metrics["loss_scale"] == 512.0
    assert trainer.progress_bar_metrics["skipped_steps"] == 1.0
    assert trainer.callback_metrics["lr"] == pytest.approx(0.05)


def test_test_subcommand_on_the_saved_last_checkpoint(tmp_path):
    main(["fit", "--config", str(CONFIGS / "digits.yaml"), *_short(tmp_path, steps=2), "--test_after_fit=false"])
    last = next(tmp_path.rglob("last.ckpt"))
    assert torch.load(last, weights_only=True)["global_step"] == 2  # the final state, not a copy of the best
    main(
        [
            "test",
            "--config",
            str(CONFIGS / "digits.yaml"),
            f"--trainer.default_root_dir={tmp_path / 'test'}",
            "--trainer.limit_test_batches=1",
            f"--ckpt_path={last}",
        ]
    )
    assert any(row.get("test_acc") for row in _metrics(tmp_path / "test"))


def test_plugin_options_without_a_mixed_precision_flag_warn_that_they_are_not_used(tmp_path):
    with pytest.warns(
        UserWarning,
        match=r"mixed_precision options \['master_weights'\] are valid but not used: "
        r"trainer.precision='32-true'",
    ):
        main(
            [
                "fit",
                "--config",
                str(CONFIGS / "digits.yaml"),
                *_short(tmp_path, steps=1),
                "--trainer.precision=32-true",
                "--mixed_precision.master_weights=true",
                "--test_after_fit=false",
            ]
        )
