"""The host work of a step cannot grow unseen: ``benchmarks/host_work.py`` counts the aten ops our code issues per
step (exact counts, the same on every machine) and each mode is held to its ``BUDGET`` (today's count; lowered as
the step-plan work lands, down to ``GOALS``). Host syncs: none in a mode whose update skips on the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host_work


@pytest.mark.parametrize("mode", sorted(host_work.BUDGET))
def test_ops_our_code_issues_per_step_stay_within_budget(mode: str) -> None:
    if "AdamW8bit" in mode:
        pytest.importorskip("torchao.optim", reason="torchao is not installed: AdamW8bit cannot be counted")
    result = host_work.count(mode, blocks=16, counted=range(2, 3))
    assert result["tensors"] == 197
    ours = host_work.ours_per_step(result)
    assert 0 < ours <= host_work.BUDGET[mode], (mode, result["ops"])
    assert sum(value for key, value in result["syncs"].items() if key.endswith("/ours")) == 0, result["syncs"]


def test_counts_credit_the_builtin_and_the_optimizer_not_us() -> None:
    result = host_work.count("built-in bf16-mixed, fused", blocks=16, counted=range(2, 3))
    assert host_work.ours_per_step(result) == 0
    assert result["ops"].get("step/optimizer", 0) >= 1  # torch's fused AdamW: one _fused_adamw_ at least
    assert any(key.startswith("forward/model") for key in result["ops"])
    assert result["ops"].get("backward/autograd", 0) > 0
