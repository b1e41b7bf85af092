"""Run a script under tests/distributed on 2 real processes (gloo on CPU), as a user's launcher would.

Each process gets ``LOCAL_RANK`` / ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, which Lightning's default
``LightningEnvironment`` reads (so one process may run several ``Trainer.fit`` calls on one process group).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(script: str, *args: str, nprocs: int = 2, timeout: float = 120.0) -> list[str]:
    """Run ``tests/distributed/<script>`` on ``nprocs`` ranks; every rank's output. Raises with all of them if one
    rank fails."""
    port = str(free_port())
    procs = []
    for rank in range(nprocs):
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "LOCAL_RANK": str(rank),
            "NODE_RANK": "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore::DeprecationWarning",
        }
        command = [sys.executable, str(REPO / "tests" / "distributed" / script), *args]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs, failed = [], False
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
            out = f"TIMEOUT after {timeout} s\n{out}"
            proc.returncode = -1
        outputs.append(f"--- rank {rank} (exit {proc.returncode}) ---\n{out[-6000:]}")
        failed = failed or proc.returncode != 0
    if failed:
        raise RuntimeError("distributed run failed:\n" + "\n".join(outputs))
    return outputs
