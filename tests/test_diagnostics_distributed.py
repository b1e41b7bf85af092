"""Diagnostics across ranks, with 2 real gloo processes on CPU: sampled counts are summed and amax is the largest;
a skipped step's record comes from the rank that reproduced the overflow, naming it."""

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_mp.diagnostics.history import OverflowRecord
from lightning_mp.diagnostics.monitor import _merged_across_ranks
from lightning_mp.diagnostics.underflow import read_rows, reduce_rows


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank r: 10 values, r + 1 zeros, 2 flushed, 3 subnormal, no non-finite, amax 5 * (r + 1)
        rows = torch.tensor([[10.0, rank + 1.0, 2.0, 3.0, 0.0, 5.0 * (rank + 1)]])
        (row,), = read_rows(reduce_rows(rows))
        located = OverflowRecord(step=7, scale_before=8.0, phase="forward", module="enc.1", module_class="Linear",
                                 op="addmm", cause="half_precision")
        record = located if rank == 1 else OverflowRecord(step=7, scale_before=8.0)  # only rank 1 overflowed
        merged = _merged_across_ranks(record)
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
