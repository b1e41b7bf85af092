"""The library type-checks: ``python -m mypy`` (configured in ``pyproject.toml``, ``[tool.mypy]``) runs clean on
``lightning_mp``. CI runs the test suite, so this is how CI runs the type checker; the few ignores in the library
each say why."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None, reason="mypy is not installed: pip install -e '.[dev]' (it pins mypy)"
)
def test_mypy_runs_clean_on_the_library():
    run = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900, check=False
    )
    output = run.stdout + run.stderr
    print(output)
    assert run.returncode == 0, output
