"""``optimizer_in_backward=True`` under FSDP2 (ModelParallelStrategy + fully_shard) on 2 real CPU processes (gloo):
each sharded parameter's local shard is updated in the hook FSDP2 runs after its reduce-scatter, bitwise the normal
lean FSDP2 step, and non-finite values skip the same updates on both ranks. The 2-rank runs are
tests/distributed/fsdp2_in_backward_checks.py (one launch for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.common import assert_same_bits, load_ranks
from tests.distributed.fsdp2_in_backward_checks import BAD_AT
from tests.distributed.launch import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("fsdp2-in-backward")
    launch("fsdp2_in_backward_checks.py", str(out), timeout=300)
    return load_ranks(out)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "adamw8bit"])
def test_fsdp2_updates_each_shard_in_backward_bitwise_the_normal_lean_step(ranks, optimizer):
    for rank in ranks:
        ours, reference = rank[f"ours_{optimizer}"], rank[f"reference_{optimizer}"]
        assert_same_bits(ours, reference, weights="weights")  # full fp32 weights and this rank's optimizer-state shards
        if optimizer == "adamw8bit":  # torchao's one-pass step on the local shards, both ways; 8-bit moments
            assert ours["step_kind"] == reference["step_kind"] == "ShardedAdam8bitStep"
            assert type(ours["optimizer_state"]["net.0.weight"]["exp_avg"]).__name__ == "OptimState8bit"
        assert ours["changed_in_backward"] == [True] * 4  # the shard changed inside backward
        assert reference["changed_in_backward"] == [False] * 4
        assert all(all(step) for step in ours["grads_after_step"])  # every gradient freed by its hook


def test_a_nan_loss_on_rank_1_only_skips_every_update_on_both_ranks(ranks):
    for rank in ranks:
        ours, reference = rank["ours_nan_loss"], rank["reference_nan_loss"]
        assert_same_bits(ours, reference, weights="weights")
        assert ours["skipped_steps"] == reference["skipped_steps"] == 1
        assert ours["changed_in_backward"] == [step != BAD_AT for step in range(4)]


@pytest.mark.parametrize("run", ["ours_inf_shard", "ours_inf_shard_device_path"])
def test_an_inf_in_one_ranks_gradient_shard_skips_that_parameter_on_both_ranks(ranks, run):
    # device path: the flags are not read at the step (an accelerator's); the names are read when asked
    rank0, rank1 = ranks
    for rank in ranks:  # rank 1's shard was finite: its update is skipped too (the flag is summed over the ranks)
        assert rank[run]["changed_in_backward"] == [step != BAD_AT for step in range(4)]
        assert rank[run]["skipped_names"] == [["net.0.weight"] if s == BAD_AT else [] for s in range(4)]
    for name, value in rank0[run]["weights"].items():
        assert torch.isfinite(value).all() and torch.equal(value, rank1[run]["weights"][name]), name
    assert_same_bits(rank0[run], rank0["ours_inf_shard"], weights="weights")  # both paths: the same bits


def test_other_optimizers_are_refused_under_fsdp2_at_setup(ranks):
    for rank in ranks:
        assert rank["generic_refusal"].startswith(
            "MixedPrecisionPlugin(optimizer_in_backward=True) under FSDP2 steps torch.optim.AdamW, torch.optim.Adam, "
            "torch.optim.SGD, torch.optim.NAdam and torchao.optim.AdamW8bit, Adam8bit (in one pass) only, not "
            "torch.optim.rmsprop.RMSprop"
        )
