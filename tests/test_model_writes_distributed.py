"""Writes into a set-up model reach the masters under DDP (both modes) and FSDP2 (lean masters): 2 real processes
(gloo, CPU); the runs are tests/distributed/write_checks.py (one launch for the module)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import load_ranks
from tests.distributed.launch import launch
from tests.distributed.write_checks import DDP_WRITES
from tests.model_writes import assert_exact
from tests.test_training_writes import assert_buffers

pytest.importorskip("litgpt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("writes")
    launch("write_checks.py", str(out), timeout=400)
    return load_ranks(out)


def test_every_write_under_ddp_reaches_the_masters_on_both_ranks(ranks):
    runs = [
        name for name in ranks[0] if name.startswith("ddp") and "dtype change" not in name and "buffers" not in name
    ]
    assert len(runs) == 2 * len(DDP_WRITES)
    for rank in ranks:
        for name in runs:
            saved, expected = rank[name]
            assert_exact(saved, expected, name)


@pytest.mark.parametrize("mode", ["remainder", "True"])
def test_loads_and_writes_in_place_under_fsdp2_reach_the_masters(ranks, mode):
    for rank in ranks:
        saved, expected = rank[f"fsdp2 {mode}"]
        assert_exact(saved, expected, f"FSDP2, master_weights={mode}")
    torch.testing.assert_close(ranks[0][f"fsdp2 {mode}"][0], ranks[1][f"fsdp2 {mode}"][0], rtol=0, atol=0)


def test_new_storage_of_another_dtype_is_refused_under_ddp_naming_the_parameter(ranks):
    # torch drops the parameter's gradient accumulator, which holds DDP's hook: without the error, DDP would raise
    # at the next forward or, with find_unused_parameters=True, leave that gradient unreduced
    for rank in ranks:
        for mode in ("True", "remainder"):
            message = rank[f"ddp dtype change {mode}"]
            assert message is not None and message.startswith("ModelWriteError"), message
            assert "'net.2.weight'" in message and "gradient accumulator" in message


@pytest.mark.parametrize("mode", ["True", "remainder"])
def test_buffers_written_during_fit_under_ddp_are_in_the_model_and_the_checkpoints(ranks, mode):
    for number, rank in enumerate(ranks):
        held, checkpoints = rank[f"ddp buffers {mode}"]
        assert_buffers(held, f"DDP rank {number}, master_weights={mode}: the model after fit")
        assert len(checkpoints) == 2
        for epoch, saved in enumerate(checkpoints):
            assert_buffers(saved, f"DDP rank {number}, master_weights={mode}: the checkpoint of epoch {epoch}")
