"""``optimizer_in_backward=True`` under Lightning Fabric's DDP on 2 real CPU processes (gloo): ``fabric.backward``
updates each bucket's parameters once its all-reduce completed, bitwise the normal lean Fabric DDP step, however the
optimizer is set up, and a NaN loss on one rank skips the same step on both. The 2-rank runs are
tests/distributed/fabric_in_backward_checks.py (one launch for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.common import assert_same_bits, load_ranks
from tests.distributed.launch import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("fabric-in-backward")
    launch("fabric_in_backward_checks.py", str(out), timeout=300)
    return load_ranks(out)


@pytest.mark.parametrize("run", ["ours", "ours_module_then_optimizer", "ours_forward_before_optimizer"])
def test_fabric_backward_updates_after_each_buckets_all_reduce_bitwise_the_normal_lean_fabric_ddp_step(ranks, run):
    """``fabric.setup(model, optimizer)``; ``setup_module`` then ``setup_optimizers``; and a forward in between (the
    module connects without an optimizer, DDP's communication hook then drives the optimizer's updates)."""
    for rank in ranks:
        ours = rank[run]
        assert_same_bits(ours, rank["reference"], steps="steps")
        assert_same_bits(ours, ranks[0][run], steps="steps")  # and the ranks hold the same bits
        assert ours["comm_hooks"] == ["_reduce_then_update"]
        assert all(ours["updated_in_backward"]) and not any(rank["reference"]["updated_in_backward"])
        assert all(all(freed) for freed in ours["grads_after_step"])  # no gradient outlives its update


def test_fabric_a_nan_loss_on_one_rank_skips_the_same_step_on_both_and_they_stay_equal(ranks):
    for rank in ranks:
        ours = rank["ours_nan"]
        assert ours["skipped_steps"] == rank["reference_nan"]["skipped_steps"] == 1
        assert_same_bits(ours, rank["reference_nan"], steps="steps")
        assert_same_bits(ours, ranks[0]["ours_nan"], steps="steps")
        assert ours["updated_in_backward"] == [True, True, False, True]  # rank 0's finite loss did not update either
    assert not torch.equal(ranks[0]["ours_nan"]["state_dict"]["3.weight"], ranks[0]["ours"]["state_dict"]["3.weight"])
