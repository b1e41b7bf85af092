"""Ranks that behave as the launcher's hard cases, run by tests/distributed/test_launch.py (no torch: they start fast).

    python tests/distributed/launch_probe.py OUT CASE

- ``leave``: each rank starts a process that outlives it and holds its output (as torch.compile's worker pool does),
  writes that process's pid to OUT/left<rank>.pid, and exits 0.
- ``flood``: rank 1 writes 1 MiB (more than a pipe holds) before it lets rank 0 finish; rank 0 waits for it.
- ``hang``: each rank writes its pid to OUT/rank<rank>.pid; rank 1 then sleeps past any timeout the tests give.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    out, case, rank = Path(sys.argv[1]), sys.argv[2], int(os.environ["LOCAL_RANK"])
    if case == "leave":
        left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # stdout: the rank's own
        (out / f"left{rank}.pid").write_text(str(left.pid))
        print(f"rank {rank} done", flush=True)
    elif case == "flood":
        if rank == 1:
            sys.stdout.write("x" * 2**20 + "\n")
            sys.stdout.flush()
            (out / "flooded").touch()
        else:
            deadline = time.monotonic() + 60
            while not (out / "flooded").exists():
                if time.monotonic() > deadline:
                    sys.exit("rank 1 never got past its output")
                time.sleep(0.05)
        print(f"rank {rank} done", flush=True)
    elif case == "hang":
        (out / f"rank{rank}.pid").write_text(str(os.getpid()))
        if rank == 1:
            time.sleep(600)
    else:
        sys.exit(f"unknown case {case!r}")


if __name__ == "__main__":
    main()
