"""Diagnostics across ranks, with 2 real gloo processes on CPU: sampled counts are summed and amax is the largest;
a skipped step's record comes from the rank that reproduced the overflow, naming it; and the PrecisionMonitor in
real DDP and FSDP2 runs (one launch of tests/distributed/monitor_checks.py for every case)."""

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mp.diagnostics.history import OverflowRecord
from lightning_mp.diagnostics.monitor import merged_across_ranks
from lightning_mp.diagnostics.underflow import read_rows, reduce_rows
from tests.distributed.common import load_ranks
from tests.distributed.launch import launch
from tests.distributed.monitor_checks import PLANT_AT


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank r: 10 values, r + 1 zeros, 2 flushed, 3 subnormal, no non-finite, amax 5 * (r + 1)
        rows = torch.tensor([[10.0, rank + 1.0, 2.0, 3.0, 0.0, 5.0 * (rank + 1)]])
        ((row,),) = read_rows(reduce_rows(rows))
        located = OverflowRecord(
            step=7,
            scale_before=8.0,
            phase="forward",
            module="enc.1",
            module_class="Linear",
            op="addmm",
            cause="half_precision",
        )
        record = located if rank == 1 else OverflowRecord(step=7, scale_before=8.0)  # only rank 1 overflowed
        merged = merged_across_ranks(record)
        results[rank] = (row, merged.module, merged.ranks, merged.cause)
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_sum_counts_take_the_largest_amax_and_report_the_rank_that_overflowed():
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(_free_port(), results), nprocs=2, join=True)
    for rank in (0, 1):
        row, module, ranks, cause = results[rank]
        assert row == [20.0, 3.0, 4.0, 6.0, 0.0, 10.0]
        assert (module, ranks, cause) == ("enc.1", [1], "half_precision")


CASES = [f"{strategy}-{masters}" for strategy in ("ddp", "fsdp2") for masters in ("off", "on")]


@pytest.fixture(scope="module")
def monitored(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("monitor")
    launch("monitor_checks.py", str(out), timeout=300)
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("plant", ["one", "every"])
def test_monitor_on_two_ranks_trains_to_the_end_and_the_ranks_agree_on_every_skip_and_the_report(
    monitored, case, plant
):
    rank0, rank1 = (ranks[plant] for ranks in load_ranks(monitored / case))
    assert rank0["skipped"] == rank1["skipped"] == [PLANT_AT]  # the overflowing step only, on both ranks
    assert len(rank0["steps"]) == 8 and rank0["steps"] == rank1["steps"]  # every batch of both epochs ran
    assert rank0["overflows"] == rank1["overflows"] and len(rank0["overflows"]) == 1
    assert rank0["report"] == rank1["report"]
    record = rank0["overflows"][0]
    assert "net.0.weight" in record["nonfinite_params"]
    if case.startswith("ddp"):  # replayed (in fp32 too, with masters swapped in) on every rank, in lockstep
        assert (record["phase"], record["module"], record["op"], record["cause"]) == (
            "forward",
            "net.0",
            "_to_copy",
            "half_precision",
        )
        assert record["ranks"] == ([0] if plant == "one" else [0, 1])
    else:  # FSDP2: the sharded model is not replayed; each rank's non-finite shards, merged
        assert (record["cause"], record["phase"]) == ("gradients_only", "")
        assert "FSDP2" in record["note"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("plant", ["one", "every"])
def test_monitor_on_two_ranks_leaves_the_weights_as_the_run_without_it(monitored, case, plant):
    for ranks in load_ranks(monitored / case):
        watched, reference = ranks[plant], ranks[f"{plant}_reference"]
        assert watched["steps"] == reference["steps"] and watched["scaler"] == reference["scaler"]
        for name, value in reference["weights"].items():
            assert torch.equal(watched["weights"][name], value), name
