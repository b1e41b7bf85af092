"""``optimizer_in_backward=True`` under DDP on 2 real CPU processes (gloo): each bucket's parameters are updated once
its all-reduce completed, bitwise the normal lean DDP step, and a NaN loss on one rank skips the same updates on both.
The 2-rank runs are tests/distributed/ddp_in_backward_checks.py (one launch for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.common import assert_same_bits, load_ranks
from tests.distributed.launch import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("ddp-in-backward")
    launch("ddp_in_backward_checks.py", str(out), timeout=300)
    return load_ranks(out)


@pytest.mark.parametrize(
    ("run", "reference"),
    [
        ("ours_adamw", "reference_adamw"),
        ("ours_sgd", "reference_sgd"),
        ("ours_rmsprop", "reference_rmsprop"),
        ("ours_adamw8bit", "reference_adamw8bit"),  # torchao's AdamW8bit: the one-pass 8-bit step
        ("ours_adamw_manual", "reference_adamw"),
        ("ours_adamw_small_buckets", "reference_adamw"),
        ("ours_adamw_bucket_views", "reference_adamw"),
    ],
)
def test_updates_after_each_buckets_all_reduce_equal_the_normal_lean_ddp_step_bitwise_on_both_ranks(
    ranks, run, reference
):
    if run not in ranks[0]:
        pytest.skip(f"{run}: torchao was not importable in the ranks")
    for rank in ranks:
        ours = rank[run]
        assert_same_bits(ours, rank[reference])
        assert_same_bits(ours, ranks[0][run])  # and the ranks hold the same bits
        assert ours["comm_hooks"] == ["_reduce_then_update"]
        assert all(ours["updated_in_backward"]) and not any(rank[reference]["updated_in_backward"])
        assert all(all(freed) for freed in ours["grads_after_step"])  # no gradient outlives its update
        if run == "ours_adamw8bit":  # net.0.weight's 4096 values: 8-bit moments, stepped inside backward
            assert type(ours["optimizer_state"][0]["exp_avg"]).__name__ == "OptimState8bit"
    # the LayerNorm (fp32 gradients) and the Linear layers (bf16) were both trained
    first, norm = ranks[0][reference]["optimizer_state"][0], ranks[0][reference]["optimizer_state"][2]
    assert first and norm


def test_an_optimizer_swapped_mid_fit_is_stepped_after_each_buckets_all_reduce_bitwise_the_normal_step(ranks):
    for rank in ranks:  # trainer.strategy.setup_optimizers at step 2: the communication hook drives the new one
        ours = rank["ours_swap"]
        assert_same_bits(ours, rank["reference_swap"])
        assert_same_bits(ours, ranks[0]["ours_swap"])
        assert all(ours["updated_in_backward"])
        assert all("momentum_buffer" in state for state in ours["optimizer_state"].values())  # SGD's


@pytest.mark.parametrize("run", ["ours_nan", "ours_nan_device_path"])
def test_a_nan_loss_on_one_rank_skips_the_same_updates_on_both_and_they_stay_equal(ranks, run):
    # device path: the flags are not read at the step (an accelerator's), the scaler counts the skip on the device
    for rank in ranks:
        ours = rank[run]
        assert ours["skipped_steps"] == rank["reference_nan"]["skipped_steps"] == 1
        assert_same_bits(ours, rank["reference_nan"])
        assert_same_bits(ours, ranks[0][run])
        # the NaN step changed nothing: rank 0 (finite loss) did not update while rank 1 skipped
        assert not ours["updated_in_backward"][2] and all(
            ours["updated_in_backward"][:2] + ours["updated_in_backward"][3:]
        )
    assert not torch.equal(
        ranks[0][run]["state_dict"]["net.0.weight"], ranks[0]["ours_adamw"]["state_dict"]["net.0.weight"]
    )


def test_find_unused_parameters_is_refused_at_setup_on_every_rank(ranks):
    for rank in ranks:
        assert "optimizer_in_backward=True) cannot run under DDP with find_unused_parameters=True" in rank.get(
            "find_unused_refusal", ""
        )


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("reentrant", "cannot follow reentrant activation checkpointing"),
        ("late_group", "cannot follow param groups added after setup"),
        (
            "partial",
            "needs every parameter DDP reduces in the optimizer, but 2 that require grad are not (net.3.weight",
        ),
    ],
)
def test_reentrant_checkpointing_a_group_added_during_fit_and_a_partial_optimizer_are_refused_on_every_rank(
    ranks, variant, message
):
    for rank in ranks:
        assert message in rank.get(f"{variant}_refusal", ""), rank.get(f"{variant}_refusal")
