"""The 2-rank launcher (tests/distributed/launch.py): a rank is done when it exits, whatever it left behind or wrote,
and no rank outlives ``launch``, whether it returns, times out or is interrupted (tests/distributed/launch_probe.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from tests.distributed import launch as launcher


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()  # running, or exited and not waited for


def _pids(folder: Path, pattern: str) -> list[int]:
    return [int(path.read_text()) for path in sorted(folder.glob(pattern))]


def test_a_rank_is_done_when_it_exits_even_if_a_process_it_started_still_holds_its_output(tmp_path):
    try:
        outputs = launcher.launch("launch_probe.py", str(tmp_path), "leave", timeout=60)
    finally:
        for pid in _pids(tmp_path, "left*.pid"):  # the test's own leftovers: the launcher does not own them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert len(outputs) == 2 and all(f"rank {rank} done" in outputs[rank] for rank in (0, 1))


def test_a_rank_that_writes_more_than_a_pipe_holds_never_blocks_the_rank_waiting_for_it(tmp_path):
    outputs = launcher.launch("launch_probe.py", str(tmp_path), "flood", timeout=60)
    assert "rank 0 done" in outputs[0] and outputs[1].rstrip().endswith("rank 1 done")


def test_a_rank_past_the_timeout_is_killed_and_no_rank_outlives_the_launch(tmp_path):
    with pytest.raises(RuntimeError, match="TIMEOUT after 3.0 s") as raised:
        launcher.launch("launch_probe.py", str(tmp_path), "hang", timeout=3.0)
    assert "--- rank 0 (exit 0) ---" in str(raised.value)
    pids = _pids(tmp_path, "rank*.pid")
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_an_interrupted_launch_leaves_no_rank_running(tmp_path, monkeypatch):
    class Interrupted:
        @staticmethod
        def monotonic() -> float:
            deadline = time.monotonic() + 30
            while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)  # both ranks running, then Ctrl-C while the launcher waits for them
            raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "time", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        launcher.launch("launch_probe.py", str(tmp_path), "hang", timeout=60)
    pids = _pids(tmp_path, "rank*.pid")
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)
