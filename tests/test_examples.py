"""Each example runs as written (briefly) and prints what its docstring promises.

The examples run in a module fixture, two processes at a time (each spends most of its seconds importing Lightning
on one core), and each test waits for its own example's output."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import finished, started_per_test

ROOT = Path(__file__).resolve().parent.parent
#: test -> the example script and its arguments (``{root}``: a fresh folder for what the example writes)
EXAMPLES = {
    "test_train_with_plugin_example": ["train_with_plugin.py", "--max-epochs", "2"],
    "test_train_with_plugin_example_in_fp16_reports_the_scaler": [
        "train_with_plugin.py", "--precision", "16-mixed", "--max-epochs", "1", "--init-scale", "1024",
    ],
    "test_subclass_plugin_example_reports_skipped_steps": ["subclass_plugin.py", "--max-epochs", "1"],
    "test_master_weights_example_shows_the_lost_and_kept_updates": ["master_weights.py", "--steps", "50"],
    "test_custom_policy_example_merges_the_module_declaration": ["custom_policy.py", "--steps", "3"],
    "test_precision_report_example_names_the_overflowing_input_layer": [
        "precision_report.py", "--root", "{root}",  # 400 steps, ~5 s
    ],
}  # fmt: skip


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "examples" / script), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def examples(request, tmp_path_factory):
    """Each chosen test's example started, two at a time: ``{test: (its future, its --root folder)}``."""
    jobs = {name: lambda root, name=name: _run(*(arg.format(root=root) for arg in EXAMPLES[name])) for name in EXAMPLES}
    with started_per_test(request, tmp_path_factory, jobs) as started:
        yield started


def _output(examples, request) -> str:
    done, _ = finished(examples, request)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_train_with_plugin_example(examples, request):
    out = _output(examples, request)
    assert "held-out accuracy:" in out


def test_train_with_plugin_example_in_fp16_reports_the_scaler(examples, request):
    out = _output(examples, request)
    assert "loss scale: 1024" in out


def test_subclass_plugin_example_reports_skipped_steps(examples, request):
    out = _output(examples, request)
    assert "skipped at scale" in out and "non-finite grads in ['net." in out


def test_master_weights_example_shows_the_lost_and_kept_updates(examples, request):
    out = _output(examples, request)
    rows = [line.strip().rsplit(None, 1) for line in out.splitlines() if line.startswith("  ")]
    lines = {name.strip(): float(value) for name, value in rows}
    assert lines["fp16 model, no masters (16-true)"] == 1.0
    assert lines["fp16 model + fp32 masters (ours)"] == pytest.approx(lines["fp32 (32-true)"], abs=1e-6)
    assert lines["fp32 (32-true)"] == pytest.approx(0.995, abs=1e-5)


def test_custom_policy_example_merges_the_module_declaration(examples, request):
    out = _output(examples, request)
    assert "softmax                            fp32     user" in out
    assert "fp32_ops=('softmax',)" in out and "fp32_modules=('model.classifier',)" in out
    assert "final training loss:" in out


def test_precision_report_example_names_the_overflowing_input_layer(examples, request):
    out = _output(examples, request)
    root = examples[request.node.originalname][1]
    assert 'advice [fp32_modules]: policy: {fp32_modules: ["encoder.0"]}' in out
    assert "encoder.0 (Linear) was where the inf/NaN was born in 10 of 15 skipped steps" in out  # every 40th step
    assert "advice [init_scale]: scaler: {init_scale: 1048576}" in out
    assert list(root.rglob("precision_report.png")) and list(root.rglob("precision_report.md"))
