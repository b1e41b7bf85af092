"""The documentation site builds with ``mkdocs build --strict``: every page in the nav, every link and anchor, every
API entry (mkdocstrings, from the docstrings of this checkout) and every included file resolve."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_docs_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]' (part of dev)")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    site = tmp_path / "site"
    for page in (
        "getting-started",
        "loss-scaling",
        "master-weights",
        "cast-policy",
        "diagnostics",
        "many-devices",
        "cli",
        "benchmarks",
        "troubleshooting",
        "architecture",
    ):
        assert (site / page / "index.html").is_file(), page
    assert (site / "precision_report.png").is_file()
    # the API reference is generated from the docstrings, and the benchmark tables are included from RESULTS.md
    assert 'id="lightning_mp.MixedPrecisionPlugin"' in (site / "reference" / "plugin" / "index.html").read_text()
    assert "Matmul 1024x768x3072" in (site / "benchmarks" / "index.html").read_text()
