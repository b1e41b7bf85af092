"""Each example runs as written (briefly) and prints what its docstring promises."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script, *args):
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_with_plugin_example():
    out = _run("train_with_plugin.py", "--max-epochs", "2")
    assert "held-out accuracy:" in out


def test_train_with_plugin_example_in_fp16_reports_the_scaler():
    out = _run("train_with_plugin.py", "--precision", "16-mixed", "--max-epochs", "1", "--init-scale", "1024")
    assert "loss scale: 1024" in out


def test_subclass_plugin_example_reports_skipped_steps():
    out = _run("subclass_plugin.py", "--max-epochs", "1")
    assert "skipped at scale" in out and "non-finite grads in ['net." in out


def test_master_weights_example_shows_the_lost_and_kept_updates():
    out = _run("master_weights.py", "--steps", "50")
    rows = [line.strip().rsplit(None, 1) for line in out.splitlines() if line.startswith("  ")]
    lines = {name.strip(): float(value) for name, value in rows}
    assert lines["fp16 model, no masters (16-true)"] == 1.0
    assert lines["fp16 model + fp32 masters (ours)"] == pytest.approx(lines["fp32 (32-true)"], abs=1e-6)
    assert lines["fp32 (32-true)"] == pytest.approx(0.995, abs=1e-5)


def test_custom_policy_example_merges_the_module_declaration():
    out = _run("custom_policy.py", "--steps", "3")
    assert "softmax                            fp32     user" in out
    assert "fp32_ops=('softmax',)" in out and "fp32_modules=('model.classifier',)" in out
    assert "final training loss:" in out


def test_precision_report_example_names_the_overflowing_input_layer(tmp_path):
    out = _run("precision_report.py", "--root", str(tmp_path))  # 400 steps, ~5 s
    assert 'advice [fp32_modules]: policy: {fp32_modules: ["encoder.0"]}' in out
    assert "encoder.0 (Linear) was where the inf/NaN was born in 10 of 15 skipped steps" in out  # every 40th step
    assert "advice [init_scale]: scaler: {init_scale: 1048576}" in out
    assert list(tmp_path.rglob("precision_report.png")) and list(tmp_path.rglob("precision_report.md"))
