"""Run a script under tests/distributed on 2 real processes (gloo on CPU), as a user's launcher would.

Each process gets ``LOCAL_RANK`` / ``NODE_RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, which Lightning's default
``LightningEnvironment`` reads (so one process may run several ``Trainer.fit`` calls on one process group).

Each rank writes into a file of its own, not a pipe: no rank can block on a full pipe while the others wait for it,
and a rank is done when it exits, even if a process it started (torch.compile's worker pool inherits its stdout)
still holds its output open. Every rank has exited and been waited for when ``launch`` returns or raises, whatever
happened meanwhile (a timeout, an interrupt): none runs on into the tests that follow.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
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
    rank fails, or if the ranks are not all done ``timeout`` seconds after the start (those still running are
    killed). The port is picked free just before the start; if another process takes it in between (this machine is
    shared), the run starts again on a new one, up to ``attempts`` times."""
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
    command = [sys.executable, str(REPO / "tests" / "distributed" / script), *args]
    with tempfile.TemporaryDirectory(prefix="launch-") as folder:
        logs = [Path(folder) / f"rank{rank}.log" for rank in range(nprocs)]
        procs: list[subprocess.Popen] = []
        late: set[int] = set()
        try:
            for rank, log in enumerate(logs):
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
                with log.open("wb") as sink:  # the child holds its own copy of the file
                    procs.append(subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            for rank, proc in enumerate(procs):
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
                except subprocess.TimeoutExpired:
                    late.add(rank)
        finally:  # a timeout, a failed start, an interrupt: no rank outlives the launch
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
            for proc in procs:
                proc.wait()
        outputs = []
        for rank, (proc, log) in enumerate(zip(procs, logs)):
            out = log.read_text(errors="replace")
            if rank in late:
                out = f"TIMEOUT after {timeout} s\n{out}"
            outputs.append(f"--- rank {rank} (exit {proc.returncode}) ---\n{out[-6000:]}")
    return outputs, bool(late) or any(proc.returncode != 0 for proc in procs)
