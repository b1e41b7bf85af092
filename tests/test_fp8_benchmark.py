"""compare.py's fp8 rows run end to end on the tiny decoder (CPU emulation), as the GPU script runs them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("torchao")


def test_compare_runs_the_decoder_in_fp8_ours_and_torchao_by_hand_against_bf16(tmp_path):
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "compare.py"),
        "--device",
        "cpu",
        "--preset",
        "tiny",
        "--workloads",
        "decoder",
        "--modes",
        "builtin-bf16",
        "fp8",
        "torchao-fp8",
        "--steps",
        "3",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    rows = {row["mode"]: row for row in result["results"]["decoder"]}
    assert result["references"] == {"decoder": "builtin-bf16"}
    for row in rows.values():
        assert row["steps"] == 3 and row["tokens_s"] == pytest.approx(row["samples_s"] * 16)
        assert math.isfinite(row["final_loss"]) and row["peak_mib"] >= 0
    # the same model, data and seed: the plugin's fp8 and torchao wired by hand compute the same thing
    assert rows["fp8"]["final_loss"] == pytest.approx(rows["torchao-fp8"]["final_loss"], rel=1e-6)
    assert rows["fp8"]["final_loss"] != rows["builtin-bf16"]["final_loss"]
    assert "| fp8 | bfloat16 |" in (tmp_path / "results.md").read_text()


def test_run_gpu_fp8_stage_is_valid_bash_and_its_command_names_what_compare_knows(tmp_path, capsys):
    """What a CPU can check of the GPU script's fp8 stage: the script parses, the stage runs its one command (shown
    with PYTHON=echo), and compare.py accepts that command's arguments; only the CUDA check is left to the GPU."""
    script = ROOT / "benchmarks" / "run_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "PYTHON": "echo", "STAGES": "fp8"}
    done = subprocess.run(["bash", str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = [line.split() for line in done.stdout.splitlines() if "compare.py" in line]
    assert len(commands) == 1 and commands[0][0] == "benchmarks/compare.py"
    argv = commands[0][1:]
    assert argv[argv.index("--workloads") + 1 : argv.index("--steps")] == ["decoder-4096"]
    modes = argv[argv.index("--modes") + 1 :]
    assert modes == ["builtin-bf16", "fp8", "builtin-bf16+compile", "fp8+compile"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import compare
        from _fp8 import DECODER_MODES, FP8_MODES
        from workloads import PRESETS
    finally:  # compare.py puts its folder on sys.path too
        while str(ROOT / "benchmarks") in sys.path:
            sys.path.remove(str(ROOT / "benchmarks"))
    assert {"decoder-2048", "decoder-4096"} <= set(PRESETS["gpu"]) and set(modes) <= set(compare.MODES)
    assert {"fp8+compile", "torchao-fp8+compile", "builtin-bf16+compile"} <= set(DECODER_MODES["cuda"])
    assert set(DECODER_MODES["cuda"]) <= set(FP8_MODES) | {"builtin-bf16", "ours-bf16"}
    if torch.cuda.is_available():
        return  # here compare.main would run the stage itself: run_gpu.sh is the check on a GPU
    with pytest.raises(SystemExit) as stopped:
        compare.main(argv)
    # argparse accepted every option; the first check after parsing is the device, which this machine lacks
    assert stopped.value.code == 2 and "--device cuda: no CUDA device is available here" in capsys.readouterr().err
