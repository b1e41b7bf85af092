"""compare.py's fp8 rows run end to end on the tiny decoder (CPU emulation), as the GPU script runs them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

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
