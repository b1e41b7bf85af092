"""ruff's lint and format checks (configured in pyproject.toml) pass on the whole repository: `.ci/run` runs them
through this test, with the ruff the ``dev`` extra installs."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    return subprocess.run([ruff, *args], cwd=ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("command", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff_passes(command):
    result = _ruff(*command)
    assert result.returncode == 0, result.stdout + result.stderr
