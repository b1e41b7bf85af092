"""The heading every benchmark prints and appends to HISTORY.md (title, date, machine, versions, command), and the
fresh process each measured mode runs in. RESULTS.md holds the current table of each machine kind and workload,
copied there by hand from a run that replaces one."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

HISTORY = Path(__file__).resolve().parent / "HISTORY.md"
#: the Trainer options of every measured fit: no logger, no checkpoint, nothing printed per step
QUIET_TRAINER = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def machine(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def rounds_table(times: dict[str, list[float]], base: str, ratio: str) -> str:
    """The table of a run whose modes alternated round by round: each mode's median per-step time (ms) over the
    rounds after the first (a warm-up), every round's time, and ``ratio`` against mode ``base``: ``"speed"``
    (base / mode, higher is faster) or ``"time"`` (mode / base, lower is faster)."""
    counted = {mode: values[1:] or values for mode, values in times.items()}
    reference = statistics.median(counted[base])
    lines = [f"| mode | ms per step (median) | rounds (ms) | {ratio} vs {base} |", "|---|---:|---|---:|"]
    for mode, values in counted.items():
        median = statistics.median(values)
        shown = ", ".join(f"{value:.3f}" for value in times[mode])
        factor = reference / median if ratio == "speed" else median / reference
        lines.append(f"| {mode} | {median:.3f} | {shown} | {factor:.2f}x |")
    return "\n".join(lines)


def report(title: str, table: str, device: str, record: bool) -> None:
    """Print ``title`` with date, machine, torch version and the exact command, then ``table``; with ``record``,
    also append them to benchmarks/HISTORY.md (the dated log; benchmarks/RESULTS.md's current tables are edited by
    hand)."""
    script = Path(sys.argv[0]).name
    text = (
        f"### {title}\n\n"
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {machine(device)}; torch {torch.__version__}\n"
        f"- command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`\n\n{table}\n"
    )
    print(text)
    if record:
        with HISTORY.open("a") as results:
            results.write("\n" + text)


def run_worker(script: str, mode: str, args: object, options: tuple[str, ...], timed_apart: bool = False) -> dict:
    """Run ``script --worker MODE`` in a fresh process (its memory is its own), passing ``--OPTION value`` for each
    of ``options`` read from ``args``; return the dict the worker printed on its ``RESULT {json}`` line. Exits with
    the worker's stderr when it fails. ``timed_apart``: its ``step_s`` comes from a second fresh process run with
    ``--time_only 1`` (a worker option: no heap poller there, whose ``mallinfo2`` calls slow the steps)."""
    result = _run_once(script, mode, args, options, ["--time_only", "0"] if timed_apart else [])
    if timed_apart:
        result["step_s"] = _run_once(script, mode, args, options, ["--time_only", "1"])["step_s"]
    return result


def _run_once(script: str, mode: str, args: object, options: tuple[str, ...], extra: list[str]) -> dict:
    command = [sys.executable, script, "--worker", mode, *extra]
    for option in options:
        command += [f"--{option}", str(getattr(args, option))]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if done.returncode != 0:
        sys.exit(f"mode {mode} failed:\n{done.stderr[-4000:]}")
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
