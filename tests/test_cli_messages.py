"""What `python -m lightning_mp` tells the user, and that it is true: refused options (exactly what the API
refuses), fallbacks, errors shown first and plainly, refused checkpoints, `--print_config`, the end-of-fit summary."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import lightning_mp.cli.app as cli
import lightning_mp.cli.choice as choice
from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from lightning_mp.cli import choose_precision, main
from lightning_mp.cli.checks import CLIConfigError, check_checkpoint_weights
from lightning_mp.cli.report import fit_summary

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
BERT = str(ROOT / "configs" / "bert.yaml")
TINY_BERT = (
    "--model.init_args.pretrained=false",
    "--model.init_args.config_overrides={num_hidden_layers: 1, hidden_size: 32, num_attention_heads: 2, "
    "intermediate_size: 64}",
)


def _short(tmp_path, *extra, steps=1):
    return [
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        *extra,
    ]


def _refused(capsys, *args) -> str:
    """Runs main(args), which must exit with status 2 before any work; returns what it printed on stderr."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def machine(monkeypatch):
    """Pretend to be a machine: ``machine("gpu")``, ``machine("cpu-bf16")`` (native bf16) or ``machine("cpu")``."""

    def pretend(kind: str) -> None:
        monkeypatch.setattr(choice, "_runs_on_cpu", lambda accelerator: kind != "gpu")
        monkeypatch.setattr(choice, "cpu_has_native_bf16", lambda: kind == "cpu-bf16")

    return pretend


@pytest.fixture
def lightning_log():
    """The messages logged through Lightning's logger (rank_zero_info and the like) during the test."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


# ------------------------------------------------------------- mixed_precision: what the API refuses, refused
REFUSED = [
    ("bf16-mixed", {"scaler": -1.0}),
    ("bf16-mixed", {"scaler": 1024.0}),  # a static scale with bf16: the API refuses it
    ("16-mixed", {"scaler": -1.0}),
    ("16-mixed", {"scaler": {"growth_factor": 0.5}}),
    ("16-mixed", {"scaler": {"init_scale": 1024.0, "hysterisis": 2}}),  # misspelt argument
    ("16-mixed", {"master_weights": "yes"}),
    ("16-mixed", {"policy": {"fp32_ops": ["softmaxx"]}}),
    ("32-true", {"scaler": -1.0}),  # no plugin trains, but the option is still checked
]


@pytest.mark.parametrize("kind", ["gpu", "cpu-bf16", "cpu"])
@pytest.mark.parametrize("precision, options", REFUSED)
def test_mixed_precision_options_the_api_refuses_are_refused_whatever_precision_is_chosen(
    machine, kind, precision, options
):
    machine(kind)
    with pytest.raises(ValueError) as api:
        MixedPrecisionPlugin(precision if precision != "32-true" else "16-mixed", **options)
    with pytest.raises(CLIConfigError) as refused:
        choose_precision(precision, "auto", None, options)
    assert str(api.value) in str(refused.value) and "mixed_precision options" in str(refused.value)


@pytest.mark.parametrize(
    "kind, trains, plugin_scaler",
    [("gpu", "16-mixed", 1024.0), ("cpu-bf16", "bf16-mixed", None), ("cpu", "32-true", None)],
)
def test_options_the_api_accepts_are_kept_and_those_that_do_not_apply_are_named(machine, kind, trains, plugin_scaler):
    machine(kind)
    options = {"master_weights": True, "scaler": {"init_scale": 1024.0}}
    choice = choose_precision("16-mixed", "auto", None, options)
    assert choice.trains == trains
    if trains == "32-true":
        assert choice.plugin is None and choice.unused == ("master_weights", "scaler")
    else:
        assert choice.plugin.master_weights and choice.plugin.precision == trains
        scaler = choice.plugin.scaler  # bf16: the check-only scaler (no scale), whatever the fp16 settings said
        assert (None if scaler.check_only else scaler.scale) == plugin_scaler
        assert choice.unused == (() if kind == "gpu" else ("scaler",))


@pytest.mark.parametrize("scaler", ["-1", "1024"])
def test_cli_refuses_a_scaler_with_bf16_before_any_work(tmp_path, capsys, scaler):
    err = _refused(
        capsys,
        "fit",
        "--config",
        DIGITS,
        *_short(tmp_path),
        "--trainer.precision=bf16-mixed",
        f"--mixed_precision.scaler={scaler}",
    )
    assert "lightning_mp: error: mixed_precision options {'scaler': " in err
    assert "refused with trainer.precision='bf16-mixed'" in err
    assert not tmp_path.exists() or not list(tmp_path.rglob("*.ckpt"))


# ------------------------------------------------------------------------------- the CPU fallback, in words
def test_the_readme_master_weights_command_on_a_cpu_without_bf16_says_the_fallback_chose_fp32(tmp_path, machine):
    machine("cpu")
    with pytest.warns(UserWarning) as warned:
        main(
            [
                "fit",
                "--config",
                DIGITS,
                *_short(tmp_path),
                "--test_after_fit=false",
                "--mixed_precision.master_weights=true",
                "--mixed_precision.scaler={init_scale: 1024, growth_interval: 500, hysteresis: 2}",
            ]
        )
    message = next(str(w.message) for w in warned if "without a GPU" in str(w.message))
    assert message.startswith("trainer.precision='16-mixed' without a GPU, on a CPU with no native bf16")
    assert "the CPU fallback chose fp32 (32-true)" in message
    assert "mixed_precision options ['master_weights', 'scaler'] are valid but not used in fp32" in message
    assert "trainer.precision=None" not in message


def test_the_same_command_on_a_cpu_with_bf16_trains_bf16_with_master_weights_and_names_the_unused_scaler(
    tmp_path, machine, lightning_log
):
    machine("cpu-bf16")
    with pytest.warns(UserWarning, match=r"bf16-mixed instead.*mixed_precision.scaler is valid but not used"):
        main(
            [
                "fit",
                "--config",
                DIGITS,
                *_short(tmp_path),
                "--test_after_fit=false",
                "--mixed_precision.master_weights=true",
                "--mixed_precision.scaler={init_scale: 1024}",
            ]
        )
    summary = next(line for line in lightning_log if line.startswith("lightning_mp: fit ran"))
    assert "Trained in bf16-mixed with MixedPrecisionPlugin" in summary
    assert "no loss scaling (bf16 needs none), 0 of 1 steps skipped for inf/NaN gradients; master weights on" in summary


# --------------------------------------------------------------------- errors shown first and plainly
def test_a_bad_trainer_plugins_value_shows_our_message_first_and_plainly(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_mp",
            "fit",
            "--config",
            DIGITS,
            *_short(tmp_path),
            "--trainer.precision=null",
            "--trainer.plugins=lightning_mp.MixedPrecisionPlugin",
            "--trainer.plugins.scaler=-1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2
    assert lines[0] == (
        "lightning_mp: error: trainer.plugins[0] (lightning_mp.MixedPrecisionPlugin): scale=-1.0 is "
        "not allowed: it must be a finite number > 0 and <= 3.40282e+38 (the largest fp32)."
    ), done.stderr
    assert len(lines) == 1 and "Traceback" not in done.stderr and "CheckpointIO" not in done.stderr


def test_a_missing_local_model_folder_is_named_not_blamed_on_the_network(tmp_path, capsys):
    folder = tmp_path / "my-bert"
    err = _refused(capsys, "fit", "--config", BERT, *_short(tmp_path), f"--model.init_args.model_name_or_path={folder}")
    assert f"lightning_mp: error: model folder '{folder}' does not exist" in err
    assert "network" not in err and "Traceback" not in err


# ------------------------------------------------------------------------------------- --ckpt_path refused
def _digits_checkpoint(tmp_path, *extra) -> Path:
    main(["fit", "--config", DIGITS, *_short(tmp_path / "digits"), "--test_after_fit=false", *extra])
    return next((tmp_path / "digits").rglob("last.ckpt"))


def test_a_checkpoint_of_another_model_is_refused_before_training_naming_both(tmp_path, capsys):
    checkpoint = _digits_checkpoint(tmp_path, "--model.init_args.width=4")
    err = _refused(
        capsys,
        "fit",
        "--config",
        BERT,
        *_short(tmp_path / "bert"),
        *TINY_BERT,
        "--data.init_args.train_size=16",
        f"--ckpt_path={checkpoint}",
    )
    assert f"lightning_mp: error: --ckpt_path {checkpoint} was saved from a ResNetClassifier (depth=10" in err
    assert "but this run's model is lightning_mp.samples.BertClassifier" in err or "model is BertClassifier" in err
    assert "'list' object has no attribute" not in err
    assert not (tmp_path / "bert").exists() or not list((tmp_path / "bert").rglob("*.ckpt"))


def test_a_checkpoint_whose_weights_do_not_fit_is_refused_naming_the_shapes(tmp_path, capsys):
    checkpoint = _digits_checkpoint(tmp_path, "--model=tests.helpers.DigitsMLP", "--model.hidden=16")
    err = _refused(
        capsys,
        "fit",
        "--config",
        DIGITS,
        *_short(tmp_path / "again"),
        "--model=tests.helpers.DigitsMLP",
        "--model.hidden=32",
        f"--ckpt_path={checkpoint}",
    )
    assert (
        "does not fit the model DigitsMLP: different shapes (3): net.1.weight (16, 64) in the checkpoint vs "
        "(32, 64) here" in err
    )
    assert not list((tmp_path / "again").rglob("*.ckpt"))


def test_checkpoint_weights_check_names_missing_and_unexpected_entries(tmp_path):
    model = torch.nn.Linear(2, 3)
    from tests.helpers import DigitsMLP

    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": {"layer.weight": model.weight.detach()}}, path)
    with pytest.raises(
        CLIConfigError,
        match=r"not in the checkpoint \(4\): net.1.weight, net.1.bias, net.3.weight, "
        r"net.3.bias; not in the model \(1\): layer.weight",
    ):
        check_checkpoint_weights(str(path), DigitsMLP())


# ----------------------------------------------------------------------------------------- --print_config
def _printed(capsys, *args) -> tuple[list[str], dict]:
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", BERT, "--print_config", *args])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.startswith("#")], yaml.safe_load(out)


def test_print_config_shows_the_plugin_that_will_train_with_its_settings(capsys, machine, tmp_path):
    machine("gpu")
    comments, config = _printed(
        capsys, "--mixed_precision.master_weights=true", "--mixed_precision.scaler={init_scale: 1024, hysteresis: 2}"
    )
    assert config["trainer"]["precision"] is None and "mixed_precision" not in config
    (plugin,) = config["trainer"]["plugins"]
    assert plugin["class_path"] == "lightning_mp.MixedPrecisionPlugin"
    assert plugin["init_args"]["precision"] == "16-mixed" and plugin["init_args"]["master_weights"] is True
    assert plugin["init_args"]["scaler"]["init_scale"] == 1024 and plugin["init_args"]["scaler"]["hysteresis"] == 2
    assert comments[0].startswith("# lightning_mp: trains in 16-mixed with MixedPrecisionPlugin")
    printed = tmp_path / "printed.yaml"
    printed.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):  # what it printed is a config that trains with the same plugin
        main(["fit", "--config", str(printed), "--print_config"])
    out = capsys.readouterr().out
    assert out.startswith("# lightning_mp: trains with the precision plugin in trainer.plugins: MixedPrecisionPlugin")
    (again,) = yaml.safe_load(out)["trainer"]["plugins"]
    scaler = again["init_args"].pop("scaler")
    assert scaler["class_path"] == "lightning_mp.DynamicLossScaler"
    assert scaler["init_args"] == plugin["init_args"]["scaler"]
    assert again["init_args"] == {k: v for k, v in plugin["init_args"].items() if k != "scaler"}


def test_print_config_shows_the_bf16_fallback_with_the_scaler_dropped(capsys, machine):
    machine("cpu-bf16")
    comments, config = _printed(capsys, "--mixed_precision.scaler=1024")
    (plugin,) = config["trainer"]["plugins"]
    assert plugin["init_args"]["precision"] == "bf16-mixed" and plugin["init_args"]["scaler"] is None
    assert "# mixed_precision options not used here: ['scaler']." in comments


def test_print_config_shows_the_fp32_fallback(capsys, machine):
    machine("cpu")
    comments, config = _printed(capsys)
    assert config["trainer"]["precision"] == "32-true" and not config["trainer"].get("plugins")
    assert "the CPU fallback chose fp32 (32-true)" in comments[0]


# -------------------------------------------------------------------------------------- the fit summary
@pytest.mark.parametrize("master_weights", [False, True])
def test_fit_summary_gives_the_final_scale_the_skipped_steps_and_master_weights(master_weights):
    from tests.helpers import TinyRegressor, make_trainer, regression_loader

    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0), master_weights=master_weights)
    trainer = make_trainer(plugin, max_steps=4)
    trainer.fit(TinyRegressor(inject_inf_at=[1]), regression_loader())
    summary = fit_summary(
        trainer, "Trained in 16-mixed with MixedPrecisionPlugin: a test", extra=["Diagnostics report: /tmp/report.html"]
    )
    assert summary.startswith("lightning_mp: fit ran 4 optimizer steps. Trained in 16-mixed")
    assert (
        f"final loss scale 512, 1 of 4 steps skipped for inf/NaN gradients; master weights "
        f"{'on' if master_weights else 'off'}" in summary
    )
    assert "No checkpoint was written." in summary and summary.endswith("Diagnostics report: /tmp/report.html.")


def test_every_cli_fit_ends_with_the_summary_paragraph(tmp_path, lightning_log):
    main(
        [
            "fit",
            "--config",
            DIGITS,
            *_short(tmp_path, steps=-1),
            "--trainer.max_epochs=1",
            "--trainer.limit_train_batches=3",
            "--trainer.precision=null",
            "--trainer.plugins=lightning_mp.MixedPrecisionPlugin",
            "--trainer.plugins.scaler={init_scale: 1024.0}",
        ]
    )
    summary = lightning_log[-1]
    assert summary.startswith("lightning_mp: fit ran 3 optimizer steps.")
    assert "Trained with the precision plugin in trainer.plugins: MixedPrecisionPlugin, used as configured" in summary
    assert "final loss scale 1024, 0 of 3 steps skipped" in summary and "master weights off" in summary
    last = next(tmp_path.rglob("last.ckpt"))
    assert f"Last checkpoint (resume with --ckpt_path): {last}." in summary
    assert "Best checkpoint (max val_acc, val_acc=" in summary
    assert "Test set evaluated on the best checkpoint" in summary
    assert f"Logs: {next(tmp_path.rglob('metrics.csv'))}." in summary
    report = next(tmp_path.rglob("precision_report.md"))
    assert (
        f"The precision report (loss scale, skipped steps, gradient statistics, and what to change) is {report}"
        in summary
    )


def test_a_checkpoint_of_the_same_model_with_other_settings_says_whose_settings_are_used(tmp_path, lightning_log):
    checkpoint = _digits_checkpoint(tmp_path, "--model.init_args.width=4")
    main(
        [
            "test",
            "--config",
            DIGITS,
            f"--trainer.default_root_dir={tmp_path / 'test'}",
            "--trainer.limit_test_batches=1",
            "--trainer.enable_progress_bar=false",
            f"--ckpt_path={checkpoint}",
        ]
    )
    assert (
        f"lightning_mp: the model is built with the settings saved in {checkpoint}: width=4 (config: 16)."
        in lightning_log
    )


def test_print_config_of_an_fp32_run_changes_nothing_but_says_so(capsys, machine):
    machine("cpu")
    comments, config = _printed(capsys, "--trainer.precision=32-true")
    assert config["trainer"]["precision"] == "32-true" and not config["trainer"].get("plugins")
    assert comments == [
        "# lightning_mp: trains in 32-true without MixedPrecisionPlugin: trainer.precision='32-true': "
        "the CLI adds MixedPrecisionPlugin only for 16-mixed or bf16-mixed."
    ]


# ------------------------------------------------------------------------- words that match the run
def test_the_summary_counts_this_runs_steps_after_a_resume_and_says_when_nothing_was_left(tmp_path, lightning_log):
    mlp = (
        "--model=tests.helpers.DigitsMLP",
        "--model.hidden=16",
        "--test_after_fit=false",
        "--precision_monitor.enabled=false",
    )
    main(["fit", "--config", DIGITS, *_short(tmp_path / "first", steps=2), *mlp])
    last = next((tmp_path / "first").rglob("last.ckpt"))
    assert torch.load(last, weights_only=True)["global_step"] == 2
    main(["fit", "--config", DIGITS, *_short(tmp_path / "more", steps=3), *mlp, f"--ckpt_path={last}"])
    main(["fit", "--config", DIGITS, *_short(tmp_path / "nothing", steps=2), *mlp, f"--ckpt_path={last}"])
    summaries = [line for line in lightning_log if line.startswith("lightning_mp: fit ran")]
    assert summaries[0].startswith("lightning_mp: fit ran 2 optimizer steps. ")
    assert summaries[1].startswith("lightning_mp: fit ran 1 optimizer steps, resuming at step 2 (3 in all). ")
    assert summaries[2].startswith(
        "lightning_mp: fit ran no optimizer step: it resumed at step 2, where max_steps=2 was already reached. "
    )
    assert "fit ran 2 optimizer steps" not in summaries[2]


@pytest.mark.parametrize("precision, scales", [("bf16-mixed", False), ("16-mixed", True)])
def test_loss_scale_is_shown_and_logged_only_when_the_run_scales_the_loss(tmp_path, precision, scales):
    cli_run = cli.MixedPrecisionCLI(
        args=[
            "fit",
            "--config",
            DIGITS,
            *_short(tmp_path, steps=2),
            "--model=tests.helpers.DigitsMLP",
            "--model.hidden=16",
            "--test_after_fit=false",
            "--trainer.log_every_n_steps=1",
            "--trainer.precision=null",
            f"--trainer.plugins={{class_path: lightning_mp.MixedPrecisionPlugin, init_args: {{precision: {precision}}}}}",
        ]
    )
    trainer = cli_run.trainer
    assert trainer.precision_plugin.scaler.check_only is not scales
    assert ("loss_scale" in trainer.progress_bar_metrics) is scales
    assert trainer.progress_bar_metrics["skipped_steps"] == 0.0  # the inf/NaN check runs in bf16 too
    header = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0].split(",")
    assert ("loss_scale" in header) is scales and "skipped_steps" in header
