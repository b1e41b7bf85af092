"""The CLI and examples/ddp.py on 2 DDP / FSDP2 CPU processes, and the CLI's strategy refusals before any Trainer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from lightning_mp.cli import cpu_has_native_bf16, main
from tests.helpers import started_per_test

ROOT = Path(__file__).resolve().parent.parent


def _digits_command(root: Path, precision: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lightning_mp",
        "fit",
        "--config",
        str(ROOT / "configs" / "digits.yaml"),
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.precision",
        precision,
        "--mixed_precision.master_weights",
        "true",
        f"--trainer.default_root_dir={root}",
        "--trainer.max_steps=3",
        "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
    ]


def _example_command(strategy: str) -> list[str]:
    return [sys.executable, str(ROOT / "examples" / "ddp.py"), "--strategy", strategy, "--max-epochs", "1"]


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def two_process_runs(request, tmp_path_factory):
    """The chosen tests' 2-process runs (the CLI on digits, examples/ddp.py), started two at a time (each process
    spends most of its time importing on one core): ``{test id: (its future, its folder)}``."""
    runs = {
        "digits-16-mixed": lambda root: _digits_command(root, "16-mixed"),
        "digits-bf16-mixed": lambda root: _digits_command(root, "bf16-mixed"),
        "example-ddp": lambda root: _example_command("ddp"),
        "example-fsdp2": lambda root: _example_command("fsdp2"),
    }
    of_test = {
        "test_cli_trains_digits_on_two_ddp_cpu_processes_with_master_weights": ("digits", "precision"),
        "test_ddp_example_runs_on_two_cpu_processes_as_written": ("example", "strategy"),
    }

    def key(item: Any) -> Optional[str]:
        kind, param = of_test.get(item.originalname, (None, None))
        return f"{kind}-{item.callspec.params[param]}" if kind else None

    jobs = {name: lambda folder, name=name: _run(runs[name](folder), folder) for name in runs}
    with started_per_test(request, tmp_path_factory, jobs, key) as started:
        yield started


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_cli_trains_digits_on_two_ddp_cpu_processes_with_master_weights(two_process_runs, precision):
    future, tmp_path = two_process_runs[f"digits-{precision}"]
    done = future.result()
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


@pytest.mark.parametrize(
    "strategy, fragment",
    [
        ("fsdp", "Lightning's FSDPStrategy (FSDP1)"),
        ("fsdp_cpu_offload", "Lightning's FSDPStrategy (FSDP1)"),
        ("{class_path: lightning.pytorch.strategies.FSDPStrategy}", "Lightning's FSDPStrategy (FSDP1)"),
        ("deepspeed_stage_2", "DeepSpeed runs its own loss scaler"),
    ],
)
@pytest.mark.parametrize("plugin", ["trainer.precision", "trainer.plugins"])
def test_cli_refuses_fsdp1_and_deepspeed_with_what_to_use_instead(tmp_path, capsys, strategy, fragment, plugin):
    precision = (
        ["--trainer.precision", "bf16-mixed"]
        if plugin == "trainer.precision"
        else ["--trainer.precision", "null", "--trainer.plugins", "lightning_mp.MixedPrecisionPlugin"]
    )
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "digits.yaml"),
        "--trainer.strategy",
        strategy,
        *precision,
        f"--trainer.default_root_dir={tmp_path}",
    ]
    with pytest.raises(SystemExit) as exited:
        main(args)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.startswith("lightning_mp: error: trainer.strategy=") and fragment in err
    assert f"with MixedPrecisionPlugin (from {plugin}" in err and "--trainer.strategy ddp" in err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ddp_example_runs_on_two_cpu_processes_as_written(two_process_runs, strategy):
    done = two_process_runs[f"example-{strategy}"][0].result()
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f"{strategy} on 2 processes" in done.stdout and "master_weights=True" in done.stdout
    assert "held-out accuracy:" in done.stdout and "after 16 optimizer steps, 0 skipped" in done.stdout
    if strategy == "ddp":
        assert "fp32 weights bitwise identical on all 2 ranks: True" in done.stdout


def test_cli_test_loss_on_two_ddp_processes_is_the_mean_over_both_ranks_shards(tmp_path):
    import csv

    from torch.utils.data import DistributedSampler

    from lightning_mp.samples import ImageDataModule, ResNetClassifier

    config = str(ROOT / "configs" / "digits.yaml")
    main(
        [
            "fit",
            "--config",
            config,
            "--trainer.precision=32-true",
            f"--trainer.default_root_dir={tmp_path / 'fit'}",
            "--model.init_args.width=8",
            "--trainer.max_steps=15",
            "--trainer.limit_val_batches=0",
            "--trainer.enable_progress_bar=false",
            "--test_after_fit=false",
            "--precision_monitor.enabled=false",
        ]
    )
    checkpoint = next((tmp_path / "fit").rglob("last.ckpt"))
    command = [
        sys.executable,
        "-m",
        "lightning_mp",
        "test",
        "--config",
        config,
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--trainer.accelerator",
        "cpu",
        "--trainer.precision",
        "32-true",
        f"--trainer.default_root_dir={tmp_path / 'test'}",
        "--trainer.limit_test_batches=2",
        "--trainer.enable_progress_bar=false",
        f"--ckpt_path={checkpoint}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    with next((tmp_path / "test").rglob("metrics.csv")).open() as handle:
        logged = float(next(row for row in csv.DictReader(handle) if row.get("test_loss"))["test_loss"])

    # the same weights and data here, in one process: each rank's shard as Lightning's DistributedSampler cuts it
    saved = torch.load(checkpoint, weights_only=True)
    hparams = {k: v for k, v in saved["hyper_parameters"].items() if not k.startswith("_")}  # _class_path, ...
    model = ResNetClassifier(**hparams).eval()
    model.load_state_dict(saved["state_dict"])
    data = ImageDataModule(source="digits", batch_size=64)
    data.setup("test")
    dataset = data.test_dataloader().dataset
    losses = []
    for rank in range(2):
        indices = list(DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=False))[: 2 * 64]
        images, labels = (torch.stack(items) for items in zip(*(dataset[i] for i in indices)))
        with torch.no_grad():
            losses.append(torch.nn.functional.cross_entropy(model(images), labels, reduction="none"))
    both, rank0 = torch.cat(losses).mean().item(), losses[0].mean().item()
    assert abs(both - rank0) > 1e-2  # the two shards differ: rank 0's alone would be a different figure
    assert logged == pytest.approx(both, rel=1e-5), (logged, both, rank0)
