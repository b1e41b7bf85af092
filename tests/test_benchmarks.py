"""The benchmark scripts run end to end (tiny sizes, CPU), so a GPU session can run them as they are."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_memory_benchmark_runs_and_reports_every_mode(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--device", "cpu", "--size", "tiny",
               "--steps", "1", "--batch", "2", "--seq", "16", "--modes", "fp32", "ours+masters", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["fp32", "ours+masters"]
    fp32, masters = rows
    # the tiny encoder's norm parameters stay fp32 (16 bytes each), every other one costs 18 with masters
    assert fp32["state_bytes"] == 16 * fp32["params"]
    assert 16 * masters["params"] < masters["state_bytes"] < 18 * masters["params"]
    assert "| ours+masters | bf16-mixed |" in done.stdout


def test_policy_overhead_benchmark_runs():
    command = [sys.executable, str(ROOT / "benchmarks" / "policy_overhead.py"), "--steps", "1", "--batch", "2",
               "--seq", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for policy in ("autocast", "passthrough", "conservative"):
        assert f"| {policy} |" in done.stdout
