"""The plugin in a Fabric loop on 2 real CPU processes (gloo), DDP and FSDP2 (``ModelParallelStrategy``), against
the Trainer path in the same processes: the same model, data, settings and clipping end bitwise where the Trainer
ends. Skips are agreed over the ranks; ``fabric.save`` / ``fabric.load`` resume bit-exactly. FSDP2 with lean masters
runs torchao's ``AdamW8bit`` in one pass on the local shards, as the Trainer does. The runs are
tests/distributed/fabric_checks.py (one launch for the module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed.common import INJECT_AT, load_ranks
from tests.distributed.fabric_checks import RUNS
from tests.distributed.launch import launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out: Path = tmp_path_factory.mktemp("fabric")
    launch("fabric_checks.py", str(out), timeout=500)
    return load_ranks(out)


@pytest.mark.parametrize("run", sorted(RUNS))
def test_fabric_loop_on_two_ranks_ends_bitwise_where_the_trainer_ends(ranks, run):
    """DDP (masters True and remainder, fp32 and bf16 reduction, accumulation under no_backward_sync through DDP's
    buckets), fp16 with the dynamic scaler, FSDP2 with the plugin's sharding policy (lean masters also with torchao's
    AdamW8bit): fp32 values and scaler state."""
    for rank in ranks:
        trainer, fabric = rank[run]["trainer"], rank[run]["fabric"]
        assert list(trainer["weights"].values())  # the Trainer's fp32 values after fit (net.*) ...
        for expected, got in zip(trainer["weights"].values(), fabric["state"].values()):  # ... and fabric.save's
            assert got.dtype == torch.float32 and torch.equal(got, expected)
        assert fabric["scaler"] == trainer["scaler"]
    for a, b in zip(ranks[0][run]["fabric"]["state"].values(), ranks[1][run]["fabric"]["state"].values()):
        assert torch.equal(a, b)


def test_an_inf_on_one_rank_skips_the_step_on_both(ranks):
    steps = [rank["inject"]["steps"] for rank in ranks]
    assert steps[0] == steps[1]
    skipped = [0] + [count for _, _, count in steps[0]]
    assert [s for s in range(len(skipped) - 1) if skipped[s + 1] > skipped[s]] == [INJECT_AT]
    for a, b in zip(ranks[0]["inject"]["state"].values(), ranks[1]["inject"]["state"].values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "masters",
    [
        "masters",
        "remainder",
        "fsdp2_masters",
        "fsdp2_remainder",
        "fsdp2_masters_dcp",
        "fsdp2_remainder_dcp",
        "fsdp2_remainder_8bit_dcp",
    ],
)
def test_fabric_load_after_an_interrupted_two_rank_run_resumes_bit_exactly(ranks, masters):
    """DDP; FSDP2 with a single-file checkpoint (``save_distributed_checkpoint=False``) and with a distributed one
    (``_dcp``: a folder, each rank its shards; the plugin's entry in its metadata); lean masters with torchao's
    AdamW8bit (``_8bit``: its 8-bit state saved and loaded as each rank's shards)."""
    for rank in ranks:
        whole, resumed = rank[f"whole_{masters}"], rank[f"resumed_{masters}"]
        assert resumed["steps"] == whole["steps"][len(whole["steps"]) - len(resumed["steps"]) :]
        assert resumed["scaler"] == whole["scaler"]
        for a, b in zip(whole["state"].values(), resumed["state"].values()):
            assert torch.equal(a, b)


#: what the lean store ran torchao's AdamW8bit with (in one pass on the local shards), and the kinds of the 64x128
#: weight's moments: torchao's quantised state (its 64x64 local shard: 4096 values) inside a DTensor
EIGHT_BIT = {
    "step": "ShardedAdam8bitStep",
    "state": {"exp_avg": ("DTensor", "OptimState8bit"), "exp_avg_sq": ("DTensor", "OptimState8bit")},
}


def test_fabric_fsdp2_lean_masters_run_torchao_adamw8bit_in_one_pass_on_8bit_local_shards(ranks):
    """The Trainer's run and Fabric's (uninterrupted, and resumed from the distributed checkpoint: the loaded state is
    still 8-bit) took the 8-bit path, on every rank."""
    for rank in ranks:
        assert rank["fsdp2_remainder_8bit"]["trainer"]["8bit"] == EIGHT_BIT
        assert rank["fsdp2_remainder_8bit"]["fabric"]["8bit"] == EIGHT_BIT
        assert rank["whole_fsdp2_remainder_8bit_dcp"]["8bit"] == EIGHT_BIT
        assert rank["resumed_fsdp2_remainder_8bit_dcp"]["8bit"] == EIGHT_BIT


def test_fabric_fsdp2_lean_masters_refuse_8bit_state_with_single_file_checkpoints_at_setup(ranks):
    """``save_distributed_checkpoint=False`` with AdamW8bit: a ValueError from ``fabric.setup_optimizers`` (the state
    is made there), before any step, on both ranks."""
    for rank in ranks:
        error = rank["8bit_whole_file"]
        assert "save_distributed_checkpoint=False" in error and "OptimState8bit" in error


def test_lean_masters_under_fabric_fsdp2_say_to_shard_before_setup_module(ranks):
    for rank in ranks:
        message = rank["lean_fsdp2_in_parallelize_fn"]
        assert "not sharded yet" in message and "parallelize_fn=lambda model, mesh: model" in message


def test_fabric_precision_monitor_on_two_ranks_localises_rank_0s_inf_on_both(ranks):
    """The inf is in rank 0's batch only; the skip is agreed, both ranks replay in lockstep and end with rank 0's
    record: the first op that read it, the first Linear's ``addmm``."""
    records = [rank["monitor"]["history"].overflows for rank in ranks]
    assert [len(r) for r in records] == [1, 1]
    for (record,) in records:
        assert (record.step, record.phase, record.module, record.op, record.ranks) == (
            INJECT_AT,
            "forward",
            "0",
            "addmm",
            [0],
        )
    assert ranks[0]["monitor"]["history"].skipped == ranks[1]["monitor"]["history"].skipped == [INJECT_AT]
    assert ranks[0]["monitor"]["history"].samples
