"""Every configuration `python -m lightning_mp` refuses says so in one line, `lightning_mp: error: ...`, exit status 2,
before any work: run as a user runs it (the real CLI in a subprocess), reading stderr and the exit status.

Each family of refusal (a precision flag, a checkpoint, the plugin's YAML) runs once as a real subprocess, the
three together in one module fixture (each spends most of its few seconds importing Lightning); every case also
runs in-process through the same ``main`` that ``python -m lightning_mp`` calls, which is what the exit status and
the one line come from.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from lightning_mp.cli import main

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
PLUGIN = "lightning_mp.MixedPrecisionPlugin"


def _plugins_yaml(init_args: str, class_path: str = PLUGIN) -> str:
    return f"trainer:\n  precision: null\n  plugins:\n    - class_path: {class_path}\n      init_args: {init_args}\n"


# case: (extra arguments, files to write first {name: bytes | str | None (a folder)}, fragments the one line holds)
CASES = {
    "32-true with a plugin": (
        ["--trainer.precision=32-true", f"--trainer.plugins={PLUGIN}"],
        {},
        [
            "trainer.precision='32-true' and a precision plugin in trainer.plugins (MixedPrecisionPlugin)",
            "--trainer.precision null",
        ],
    ),
    "ckpt random bytes": (
        ["--ckpt_path=random.ckpt"],
        {"random.ckpt": bytes(range(256)) * 8},
        ["--ckpt_path random.ckpt is not a checkpoint torch.load can read (2048 bytes)", "not a file torch.save"],
    ),
    "ckpt text": (
        ["--ckpt_path=notes.ckpt"],
        {"notes.ckpt": "version https://git-lfs.github.com/spec/v1\n"},
        ["--ckpt_path notes.ckpt is not a checkpoint torch.load can read", "b'version https://"],
    ),
    "ckpt empty": (["--ckpt_path=empty.ckpt"], {"empty.ckpt": b""}, ["--ckpt_path empty.ckpt is an empty file"]),
    "ckpt folder": (
        ["--ckpt_path=checkpoints"],
        {"checkpoints": None, "checkpoints/last.ckpt": b"x"},
        ["--ckpt_path checkpoints is a folder (last.ckpt in it), not a checkpoint"],
    ),
    "ckpt missing": (["--ckpt_path=gone.ckpt"], {}, ["--ckpt_path gone.ckpt: no such file"]),
    "ckpt bare state dict": (
        ["--ckpt_path=weights.pt"],
        {"weights.pt": {"layer.weight": torch.zeros(2)}},
        ["--ckpt_path weights.pt holds a bare state dict (1 tensors) and no 'state_dict'"],
    ),
    "scaler edited by hand": (
        ["--ckpt_path=edited.ckpt"],
        {"edited.ckpt": "EDITED"},
        [
            "--ckpt_path edited.ckpt: ['MixedPrecisionPlugin']['scaler']: backoff_factor=2.0 is not allowed",
            "> 0 and < 1",
            "edited by hand",
        ],
    ),
    "monitor out of range": (
        ["--precision_monitor.sample_every=-5"],
        {},
        ["PrecisionMonitor(sample_every=-5): must be an integer >= 0"],
    ),
    "monitor not a number": (
        ["--precision_monitor.log_top=many"],
        {},
        ["--precision_monitor.log_top: Expected a <class 'int'>", "many"],
    ),
    "fsdp": (
        ["--trainer.strategy=fsdp", "--trainer.precision=bf16-mixed"],
        {},
        ["trainer.strategy='fsdp' with MixedPrecisionPlugin", "FSDPPrecision", "--trainer.strategy ddp"],
    ),
    "deepspeed": (
        ["--trainer.strategy=deepspeed_stage_2", "--trainer.precision=bf16-mixed"],
        {},
        ["trainer.strategy='deepspeed_stage_2' with MixedPrecisionPlugin", "DeepSpeedPrecision"],
    ),
    "plugin argument typo": (
        ["--config=plugins.yaml"],
        {"plugins.yaml": _plugins_yaml("{master_weight: true}")},
        [
            "trainer.plugins[0] (lightning_mp.MixedPrecisionPlugin): 'master_weight' is not an argument",
            "did you mean 'master_weights'?",
            "it takes precision, scaler, master_weights, keep_norm_fp32, policy",
        ],
    ),
    "plugin class typo": (
        ["--config=plugins.yaml"],
        {"plugins.yaml": _plugins_yaml("{}", "lightning_mp.MixedPrecisionPlugn")},
        [
            "trainer.plugins[0]: class_path 'lightning_mp.MixedPrecisionPlugn' cannot be imported",
            "did you mean lightning_mp.MixedPrecisionPlugin?",
        ],
    ),
}


def _edited_checkpoint(folder: Path) -> dict:
    """A real checkpoint of a 1-step bf16 fit with the plugin, its scaler's backoff_factor edited to 2.0."""
    main(
        [
            "fit",
            "--config",
            DIGITS,
            "--model=tests.helpers.DigitsMLP",
            "--trainer.precision=bf16-mixed",
            f"--trainer.default_root_dir={folder}",
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--test_after_fit=false",
            "--precision_monitor.enabled=false",
        ]
    )
    checkpoint = torch.load(next(folder.rglob("last.ckpt")), weights_only=True)
    assert checkpoint["MixedPrecisionPlugin"]["scaler"]["backoff_factor"] == 0.5
    checkpoint["MixedPrecisionPlugin"]["scaler"]["backoff_factor"] = 2.0
    return checkpoint


#: one case per family of refusal, run as a real subprocess as well
SUBPROCESS_CASES = ("32-true with a plugin", "ckpt random bytes", "plugin argument typo")


def _arguments(case: str) -> list[str]:
    return [
        "fit",
        "--config",
        DIGITS,
        *CASES[case][0],
        "--trainer.default_root_dir=runs",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
        "--test_after_fit=false",
    ]


def _write_files(case: str, folder: Path, edited: dict) -> None:
    folder.mkdir(parents=True)
    files = CASES[case][1]
    for name, content in files.items():
        target = folder / name
        if content is None:
            target.mkdir()
        elif isinstance(content, bytes):
            target.write_bytes(content)
        elif isinstance(content, dict) or content == "EDITED":
            torch.save(edited if content == "EDITED" else content, target)
        else:
            target.write_text(content)


def _run(case: str, folder: Path, edited: dict) -> subprocess.CompletedProcess:
    _write_files(case, folder, edited)
    command = [sys.executable, "-m", "lightning_mp", *_arguments(case)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def edited(tmp_path_factory) -> dict:
    return _edited_checkpoint(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, edited) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("refusals")
    folders = {case: root / f"case{index}" for index, case in enumerate(SUBPROCESS_CASES)}
    with ThreadPoolExecutor(max_workers=len(SUBPROCESS_CASES)) as pool:
        done = dict(zip(SUBPROCESS_CASES, pool.map(lambda case: _run(case, folders[case], edited), SUBPROCESS_CASES)))
    return {case: (folders[case], done[case]) for case in SUBPROCESS_CASES}


def _assert_refused(case: str, folder: Path, returncode: int, stderr: str, stdout: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("lightning_mp: error: "), stderr[-3000:]
    for fragment in CASES[case][2]:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in stderr + stdout
    assert not (folder / "runs").exists()  # before any work: no log folder, no checkpoint


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_a_refused_configuration_is_one_error_line_exit_2_before_any_work_in_a_subprocess(refusals, case):
    folder, done = refusals[case]
    _assert_refused(case, folder, done.returncode, done.stderr, done.stdout)


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_configuration_is_one_error_line_exit_2_before_any_work(tmp_path, monkeypatch, capsys, edited, case):
    folder = tmp_path / "case"
    _write_files(case, folder, edited)
    monkeypatch.chdir(folder)
    with pytest.raises(SystemExit) as exited:
        main(_arguments(case))
    out = capsys.readouterr()
    _assert_refused(case, folder, exited.value.code, out.err, out.out)


@pytest.mark.parametrize("precision", ["32-true", "32", "16-true", "bf16-true", "64-true", "transformer-engine"])
def test_any_precision_flag_next_to_a_precision_plugin_is_refused_naming_both(precision):
    from lightning_mp import MixedPrecisionPlugin
    from lightning_mp.cli import choose_precision
    from lightning_mp.cli.checks import CLIConfigError

    with pytest.raises(CLIConfigError) as refused:
        choose_precision(precision, "cpu", [{"class_path": PLUGIN}], {})
    assert f"trainer.precision={precision!r} and a precision plugin in trainer.plugins (MixedPrecisionPlugin)" in str(
        refused.value
    )
    with pytest.raises(CLIConfigError, match=r"holds 2 precision plugins \(MixedPrecisionPlugin, MixedPrecision"):
        choose_precision(
            None,
            "cpu",
            [
                MixedPrecisionPlugin(),
                {
                    "class_path": "lightning.pytorch.plugins.precision.MixedPrecision",
                    "init_args": {"precision": "bf16-mixed", "device": "cpu"},
                },
            ],
            {},
        )


@pytest.mark.parametrize(
    "argument, expected",
    [
        (
            "--model.init_args.widht=3",
            "--model: lightning_mp.samples.ResNetClassifier: Option 'widht' is not accepted "
            "(did you mean 'width'?); ResNetClassifier takes depth, num_classes, in_channels, "
            "width, stem, lr, momentum, weight_decay.",
        ),
        (
            "--data.init_args.batch_size=abc",
            '--data: lightning_mp.samples.ImageDataModule: Parser key "batch_size": '
            "Expected a <class 'int'>. Got value: abc",
        ),
        ("--trainer.max_stepz=3", "unrecognized arguments: --trainer.max_stepz=3"),
    ],
)
def test_a_mistyped_model_or_data_argument_is_one_line_naming_the_class_and_its_arguments(
    tmp_path, capsys, argument, expected
):
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config", DIGITS, f"--trainer.default_root_dir={tmp_path}", argument])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == f"lightning_mp: error: {expected}\n"
    assert not any(tmp_path.iterdir())
