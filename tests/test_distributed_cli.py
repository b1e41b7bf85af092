"""The CLI and examples/ddp.py on 2 DDP / FSDP2 CPU processes, and the CLI's strategy refusals before any Trainer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_mp.cli import cpu_has_native_bf16, main

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_cli_trains_digits_on_two_ddp_cpu_processes_with_master_weights(tmp_path, precision):
    command = [
        sys.executable, "-m", "lightning_mp", "fit", "--config", str(ROOT / "configs" / "digits.yaml"),
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.precision", precision, "--mixed_precision.master_weights", "true",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3", "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=1", "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output  # Lightning started the second process
    checkpoint = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False)
    assert checkpoint["global_step"] == 3
    # 16-mixed on a CPU without native bf16 trains in fp32 (the CLI's fallback, with a warning); otherwise our plugin
    with_plugin = precision == "bf16-mixed" or cpu_has_native_bf16()
    assert ("MixedPrecisionPlugin" in checkpoint) == with_plugin
    if with_plugin:
        assert "master_weights=True" in output  # "lightning_mp: training with MixedPrecisionPlugin(...)"
        assert checkpoint["MixedPrecisionPlugin"]["scaler"]["steps"] == 3
    # with master weights the checkpoint holds the fp32 masters; the fp32 fallback holds the fp32 model
    assert {t.dtype for t in checkpoint["state_dict"].values() if t.is_floating_point()} == {torch.float32}


@pytest.mark.parametrize("strategy, fragment", [
    ("fsdp", "Lightning's FSDPStrategy (FSDP1)"),
    ("deepspeed_stage_2", "DeepSpeed runs its own loss scaler"),
])
def test_cli_refuses_fsdp1_and_deepspeed_with_what_to_use_instead(tmp_path, strategy, fragment):
    args = ["fit", "--config", str(ROOT / "configs" / "digits.yaml"), "--trainer.strategy", strategy,
            "--trainer.precision", "bf16-mixed", f"--trainer.default_root_dir={tmp_path}"]
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        main(args)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ddp_example_runs_on_two_cpu_processes_as_written(tmp_path, strategy):
    command = [sys.executable, str(ROOT / "examples" / "ddp.py"), "--strategy", strategy, "--max-epochs", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"{strategy} on 2 processes" in done.stdout and "master_weights=True" in done.stdout
    assert "held-out accuracy:" in done.stdout and "after 16 optimizer steps, 0 skipped" in done.stdout
    if strategy == "ddp":
        assert "fp32 weights bitwise identical on all 2 ranks: True" in done.stdout
