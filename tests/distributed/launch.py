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


# set by a launcher or by Lightning in an earlier run of this process: they would change how Lightning sees the ranks
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
    "PL_TRAINER_GPUS",
    "SLURM_NTASKS",
    "SLURM_JOB_NAME",
)
_PORT_TAKEN = ("Address already in use", "EADDRINUSE")


def launch(script: str, *args: str, nprocs: int = 2, timeout: float = 120.0, attempts: int = 3) -> list[str]:
    """Run ``tests/distributed/<script>`` on ``nprocs`` ranks; every rank's output. Raises with all of them if one
    rank fails. The port is picked free just before the start; if another process takes it in between (this
    machine is shared), the run starts again on a new one, up to ``attempts`` times."""
    for attempt in range(attempts):
        outputs, failed = _run_once(script, args, nprocs, timeout)
        if not failed:
            return outputs
        if not any(taken in output for output in outputs for taken in _PORT_TAKEN) or attempt == attempts - 1:
            raise RuntimeError("distributed run failed:\n" + "\n".join(outputs))
    raise AssertionError("unreachable")


def _run_once(script: str, args: tuple[str, ...], nprocs: int, timeout: float) -> tuple[list[str], bool]:
    port = str(free_port())
    base = {key: value for key, value in os.environ.items() if key not in _LAUNCHER_VARIABLES}
    procs = []
    for rank in range(nprocs):
        env = {
            **base,
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
    return outputs, failed
