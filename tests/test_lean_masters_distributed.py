"""Lean master weights on 2 real CPU processes (gloo, DDP) against one process with the whole global batch (FSDP2 in
tests/test_lean_masters_fsdp2.py). The 2-rank runs are tests/distributed/ddp_lean_checks.py (one launch for the
module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.common import INJECT_AT, fit, load_ranks
from tests.distributed.launch import launch

_EPS = torch.finfo(torch.bfloat16).eps


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("ddp-lean")
    launch("ddp_lean_checks.py", str(out), timeout=400)
    return load_ranks(out)


@pytest.fixture(scope="module")
def reference() -> dict:
    return fit("bf16-mixed", "remainder", strategy="auto", devices=1)


def test_two_ranks_match_one_process_with_the_whole_batch(ranks, reference):
    full = ranks[0]["full"]
    assert full["param_dtype"] == reference["param_dtype"] == torch.bfloat16
    for name, value in reference["weights"].items():
        assert full["weights"][name].dtype == torch.float32  # after fit: the exact fp32 values
        torch.testing.assert_close(full["weights"][name], value, rtol=0, atol=0.5 * _EPS)


def test_ddp_reduces_the_bf16_buckets_through_the_plugins_hook(ranks):
    assert ranks[0]["full"]["comm_hooks"] == ["_reduce_hook"]


def test_ranks_agree_bitwise_and_skip_the_same_step(ranks, reference):
    rank0, rank1 = ranks
    for run in ("full", "resumed", "accumulated", "bf16_reduce"):
        for name, value in rank0[run]["weights"].items():
            assert torch.equal(value, rank1[run]["weights"][name]), (run, name)
    assert rank0["full"]["steps"] == rank1["full"]["steps"] == reference["steps"]
    counts = [0] + [count for _, _, count in rank0["full"]["steps"]]
    assert [s for s in range(len(counts) - 1) if counts[s + 1] > counts[s]] == [INJECT_AT]


def test_resumed_run_continues_as_the_uninterrupted_one(ranks):
    for rank in ranks:
        full, resumed = rank["full"], rank["resumed"]
        assert resumed["steps"] == full["steps"][len(full["steps"]) - len(resumed["steps"]) :]
        for name, value in full["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name


def test_bf16_accumulation_and_bf16_reduction_train_like_the_reference(ranks, reference):
    for run in ("accumulated", "bf16_reduce"):
        for name, value in reference["weights"].items():
            torch.testing.assert_close(ranks[0][run]["weights"][name], value, rtol=0, atol=2 * _EPS)


def test_fp32_accumulation_under_ddp_is_refused_at_setup_saying_what_to_use(ranks):
    error = ranks[0]["fp32_accumulation_error"]
    assert error is not None and "accumulate_grads_in': 'bf16'" in error and "master_weights=True" in error
