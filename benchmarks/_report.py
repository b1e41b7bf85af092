"""The heading every benchmark prints and appends to RESULTS.md: title, date, machine, versions, command."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine(device: str) -> str:
    if device == "cuda":
        return f"cuda ({torch.cuda.get_device_name()})"
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def report(title: str, table: str, device: str, record: bool) -> None:
    """Print ``title`` with date, machine, torch version and the exact command, then ``table``; with ``record``,
    also append them to benchmarks/RESULTS.md."""
    script = Path(sys.argv[0]).name
    text = (
        f"### {title}\n\n"
        f"- date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {machine(device)}; torch {torch.__version__}\n"
        f"- command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`\n\n{table}\n"
    )
    print(text)
    if record:
        with RESULTS.open("a") as results:
            results.write("\n" + text)
