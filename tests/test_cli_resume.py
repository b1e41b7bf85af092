"""A CLI fit killed with SIGKILL and resumed from its ``last.ckpt`` reproduces the uninterrupted run (CPU).

Three real ``python -m lightning_mp fit`` processes per case: one uninterrupted, one frozen at a known step by a
callback and killed there with ``kill -9`` from outside, one resumed with ``--ckpt_path .../last.ckpt``. The
kill comes mid-epoch, three steps after the last step checkpoint, so the resumed run starts in the middle of an
epoch and then runs a whole further epoch: both the position in the epoch and the epoch-aware shuffle are
exercised. Losses, validation accuracy, final weights and optimizer state must be equal bit for bit.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "configs" / "digits.yaml"
FREEZE_AT = 13  # optimizer steps: 8 batches per epoch, last.ckpt every 5 steps -> the kill loses steps 11-13


class FreezeAt(L.Callback):
    """At optimizer step ``step``, writes ``marker`` and waits to be killed (the test sends SIGKILL)."""

    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            Path(self.marker).write_text(str(trainer.global_step))
            time.sleep(600)


class DropoutDigits(L.LightningModule):
    """A small MLP with dropout on the 8x8 digits: the resumed run must draw the same dropout masks."""

    def __init__(self, hidden: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.3), nn.Linear(hidden, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images).float(), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        images, labels = batch
        self.log("val_acc", (self.net(images).argmax(-1) == labels).float().mean())

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=24)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


CALLBACKS = """\
trainer:
  callbacks:
    - class_path: lightning_mp.cli.checkpoints.LastCheckpoint
      init_args: {every_n_train_steps: 5}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {monitor: val_acc, mode: max, filename: "best-{epoch}-{step}"}
"""
FREEZE = "    - class_path: tests.test_cli_resume.FreezeAt\n      init_args: {{step: {step}, marker: {marker}}}\n"

CASES = {
    # the shipped digits ResNet (narrower), fp32: the data order and the position in the epoch
    "resnet-fp32": ["--trainer.precision=32-true", "--model.init_args.width=4"],
    # dropout + real fp16 with a dynamic scaler that overflows and backs off: RNG and scaler state resume too
    "dropout-fp16-plugin": [
        "--model=tests.test_cli_resume.DropoutDigits",
        "--trainer.precision=null",
        "--trainer.plugins=lightning_mp.MixedPrecisionPlugin",
        "--trainer.plugins.precision=16-mixed",
        "--trainer.plugins.scaler={init_scale: 1048576.0, growth_interval: 4}",
    ],
    # dropout + bf16 with lean master weights (bf16 weights + 16-bit remainders): fp32 checkpoints, exact resume
    "dropout-bf16-remainder": [
        "--model=tests.test_cli_resume.DropoutDigits",
        "--trainer.precision=bf16-mixed",
        "--mixed_precision.master_weights=remainder",
    ],
}


def _command(root: Path, config: Path, extra: list[str], *more: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_mp",
        "fit",
        "--config",
        str(DIGITS),
        "--config",
        str(config),
        f"--trainer.default_root_dir={root}",
        "--trainer.max_epochs=3",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--test_after_fit=false",
        "--data.init_args.train_size=256",
        "--data.init_args.batch_size=32",
        *extra,
        *more,
    ]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }


def _run(command: list[str]) -> None:
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def _start(command: list[str]) -> subprocess.Popen:
    """A run in the background (the uninterrupted one runs while the other is killed: they share nothing)."""
    return subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen) -> None:
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-4000:]


def _kill_at_marker(command: list[str], marker: Path) -> None:
    process = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not marker.exists():
        if process.poll() is not None:
            raise AssertionError(f"the run ended before step {FREEZE_AT}: {process.stderr.read().decode()[-4000:]}")
        assert time.monotonic() < deadline, "the run did not reach the freeze step in time"
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)  # kill -9: no hook, no teardown, no checkpoint on the way out
    process.wait(timeout=60)
    process.stderr.close()
    assert process.returncode == -signal.SIGKILL


def _rows(version: Path) -> dict[int, dict[str, str]]:
    with (version / "metrics.csv").open() as handle:
        rows: dict[int, dict[str, str]] = {}
        for row in csv.DictReader(handle):
            merged = rows.setdefault(int(row["step"]), {})
            merged.update({key: value for key, value in row.items() if value != ""})
    return rows


def _assert_same_tensors(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and torch.equal(expected, actual), where
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys(), where
        for key in expected:
            _assert_same_tensors(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for index, (e, a) in enumerate(zip(expected, actual)):
            _assert_same_tensors(e, a, f"{where}[{index}]")
    else:
        assert expected == actual, f"{where}: {expected!r} != {actual!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_killed_fit_resumed_from_last_ckpt_reproduces_the_uninterrupted_run(tmp_path, case):
    config, freeze_config, marker = tmp_path / "callbacks.yaml", tmp_path / "freeze.yaml", tmp_path / "frozen"
    config.write_text(CALLBACKS)
    freeze_config.write_text(CALLBACKS + FREEZE.format(step=FREEZE_AT, marker=marker))
    whole, killed = tmp_path / "whole", tmp_path / "killed"

    uninterrupted = _start(_command(whole, config, CASES[case]))
    _kill_at_marker(_command(killed, freeze_config, CASES[case]), marker)
    last = killed / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 10  # the last multiple of 5 before the kill: mid-epoch (epoch 1, 2 of 8 batches)
    assert saved["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [{"epoch": 1, "batches": 2}]
    _run(_command(killed, config, CASES[case], f"--ckpt_path={last}"))
    _finish(uninterrupted)

    expected, resumed = _rows(whole / "lightning_logs" / "version_0"), _rows(killed / "lightning_logs" / "version_1")
    assert sorted(resumed) == [step for step in sorted(expected) if step >= 10]  # steps 11..24 and the epoch ends
    for step, row in resumed.items():
        for key in ("train_loss", "val_acc", "loss_scale", "skipped_steps", "lr"):
            assert row.get(key) == expected[step].get(key), f"{key} at step {step}"
    final_whole = torch.load(whole / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    final_resumed = torch.load(killed / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt", weights_only=True)
    assert final_whole["global_step"] == final_resumed["global_step"] == 24
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        _assert_same_tensors(final_whole[key], final_resumed[key], key)
    if case == "dropout-fp16-plugin":
        scaler = final_resumed["MixedPrecisionPlugin"]["scaler"]
        assert scaler == final_whole["MixedPrecisionPlugin"]["scaler"] and scaler["skipped_steps"] > 0
