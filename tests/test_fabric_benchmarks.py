"""The Fabric benchmark scripts run end to end (tiny sizes, CPU)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_fabric_overhead_benchmark_times_the_trainer_and_the_fabric_path():
    command = [sys.executable, str(ROOT / "benchmarks" / "fabric_overhead.py"), "--steps", "3", "--rounds", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| trainer", "| fabric"))]
    assert [row.split(" | ")[0] for row in rows] == ["| trainer+ours", "| fabric+ours", "| fabric+builtin-bf16"]
    assert rows[0].endswith("| 1.00x |")


def test_litgpt_benchmark_reports_memory_time_and_loss_per_mode():
    command = [sys.executable, str(ROOT / "benchmarks" / "fabric_litgpt.py"), "--size", "tiny"]
    command += ["--pretrain-steps", "2", "--steps", "3", "--modes", "32-true", "ours+remainder+8bit+inbackward"]
    command += ["--quick"]  # one process per mode (the figures' runs time the steps in a second one)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| 32-true", "| ours"))]
    assert [row.split(" | ")[0] for row in rows] == ["| 32-true", "| ours+remainder+8bit+inbackward"]
    assert rows[0].endswith("| +0.000% |")  # the reference of the loss column
    fp32, ours = rows[0].split(" | "), rows[1].split(" | ")
    # at the tiny size the lean step's fixed 2 MiB of staging is 4.5 bytes/param; still below fp32's 16
    assert float(ours[1]) < float(fp32[1]) and ours[-1].endswith("% |")
