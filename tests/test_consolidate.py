"""`python -m lightning_mp consolidate`: an FSDP2 run's distributed checkpoint (and a single-file one) becomes one
fp32 state dict that loads strictly into the unsharded model and holds the weights the run ended with."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed.common import Net, load_ranks
from tests.distributed.launch import launch

ROOT = Path(__file__).resolve().parent.parent
PRECISION = "bf16-mixed"


@pytest.fixture(scope="module")
def fsdp2_checkpoints(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("consolidate")
    launch("consolidate_checks.py", str(out), PRECISION, timeout=240)
    return out


def _consolidate(*args: str, capsys: pytest.CaptureFixture | None = None) -> subprocess.CompletedProcess:
    """``python -m lightning_mp consolidate ARGS``: in a real subprocess, or (given ``capsys``) in-process through
    the same ``main`` the command calls, with every warning it raises printed on its stderr."""
    command = ["consolidate", *map(str, args)]
    if capsys is None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        return subprocess.run(
            [sys.executable, "-m", "lightning_mp", *command], env=env, capture_output=True, text=True, timeout=120
        )
    from lightning_mp.cli import main

    code = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            main(command)
        except SystemExit as exited:
            code = exited.code
    out = capsys.readouterr()
    stderr = out.err + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    return subprocess.CompletedProcess(command, code, out.out, stderr)


@pytest.mark.parametrize(
    "masters, run, folder", [("off", "sharded", "ckpt-off"), ("on", "sharded", "ckpt-on"), ("on", "file", "ckpt-file")]
)
def test_consolidated_checkpoint_loads_strictly_and_holds_the_weights_the_run_ended_with(
    fsdp2_checkpoints, tmp_path, capsys, masters, run, folder
):
    ended = load_ranks(fsdp2_checkpoints / masters)[0][run]
    assert ended["param_dtype"] == (torch.bfloat16 if masters == "on" else torch.float32)  # masters: a bf16 model
    last = fsdp2_checkpoints / folder / "epoch=1.ckpt"  # written at the end of the last epoch: the final state
    assert last.is_dir() == (run == "sharded") and (run != "sharded" or (last / ".metadata").is_file())
    # one case as a real subprocess (the command as a user runs it), the others in-process (the same main)
    done = _consolidate(last, tmp_path / "model.pt", capsys=None if masters == "on" and run == "sharded" else capsys)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = Net(inject=False).state_dict()
    assert done.stdout.startswith(f"lightning_mp: wrote {len(expected)} tensors") and "strict=True" in done.stdout
    assert "Warning" not in done.stderr, done.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}
    model = Net(inject=False)  # the LightningModule as built, never sharded
    model.load_state_dict(state, strict=True)
    assert {name for name, _ in model.named_parameters()} == set(ended["weights"])
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), ended["weights"][name]), name


def test_lightnings_consolidation_fails_on_the_trainers_distributed_checkpoint(fsdp2_checkpoints, tmp_path):
    """Why the command exists: the tool Lightning documents for Trainer checkpoints expects Fabric's "model" key."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning.pytorch.utilities.consolidate_checkpoint",
            str(fsdp2_checkpoints / "ckpt-on" / "epoch=1.ckpt"),
            "--output_file",
            str(tmp_path / "out.ckpt"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "KeyError: 'model'" in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize(
    "given, fragment",
    [
        ("missing", "missing: no such file or folder."),
        ("folder", "is a folder without .metadata: not a distributed checkpoint"),
        ("text.ckpt", "is not a checkpoint torch.load can read"),
    ],
)
def test_consolidate_refuses_what_is_not_a_checkpoint_in_one_line(tmp_path, capsys, given, fragment):
    (tmp_path / "folder").mkdir()
    (tmp_path / "text.ckpt").write_text("not a checkpoint\n")
    # one case as a real subprocess, the others in-process through the same main
    done = _consolidate(tmp_path / given, tmp_path / "out.pt", capsys=None if given == "missing" else capsys)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("lightning_mp: error: ")
    assert fragment in lines[0] and not (tmp_path / "out.pt").exists()
