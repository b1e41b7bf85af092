"""fp8 on 2 real processes (gloo, CPU emulation): DDP, and FSDP2 with torchao's fp8 all-gather and the weight-scale
precompute done by the plugin (tests/distributed/fp8_checks.py)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import load_ranks
from tests.distributed.launch import launch

pytest.importorskip("torchao")


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def launched(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"fp8-{request.param}")
    launch("fp8_checks.py", str(out), request.param, timeout=300)
    return request.param, load_ranks(out)


@pytest.mark.parametrize("masters", ["masters", "no_masters"])
def test_every_rank_trains_the_same_fp8_layers_to_the_same_weights(launched, masters):
    strategy, ranks = launched
    runs = [rank[masters] for rank in ranks]
    for run in runs:
        assert run["converted"] == ["net.0", "net.2"] and run["float8_layers"] == ["net.0", "net.2"]
        assert len(run["losses"]) == 8 and run["losses"][4] < run["losses"][0]  # the same batch, one epoch later
    assert all(torch.equal(runs[0]["weights"][n], runs[1]["weights"][n]) for n in runs[0]["weights"])


@pytest.mark.parametrize("masters", ["masters", "no_masters"])
def test_fp8_cast_statistics_are_sampled_and_summed_over_the_ranks(launched, masters):
    strategy, ranks = launched
    samples = [rank[masters]["fp8_samples"] for rank in ranks]
    assert samples[0] == samples[1]  # reduced: every rank holds the same numbers
    assert [s["step"] for s in samples[0]] == [0, 4] and samples[0][0]["layers"] == ["net.0", "net.2"]
    casts = samples[0][0]["casts"]
    assert casts["input"][0][0] == 2 * 8 * 32 and casts["grad_output"][0][0] == 2 * 8 * 64  # both ranks' batches
    # DDP: each rank casts the whole weight; FSDP2 all-gathers it already in fp8, so there is nothing to sample
    assert casts["weight"][0][0] == (2 * 64 * 32 if strategy == "ddp" else 0)


@pytest.mark.parametrize("masters", ["masters", "no_masters"])
def test_fsdp2_all_gathers_fp8_weights_with_scales_the_plugin_precomputed(launched, masters):
    strategy, ranks = launched
    if strategy != "fsdp2":
        pytest.skip("FSDP2 only")
    for rank in ranks:
        run = rank[masters]
        assert "enable_fsdp_float8_all_gather=True" in run["config"]
        assert run["gathers"] and set(run["gathers"]) == {"torch.float8_e4m3fn"}  # what went over the wire
        for precomputed, expected in run["scales"]:  # after the last step: fp8 max / amax of the whole weight
            assert precomputed == pytest.approx(expected, rel=1e-6)
