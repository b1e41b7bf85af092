"""DDP and FSDP2 on 2 real CPU processes (gloo): agreed skips, masters, accumulation, clipping, resume, reduction.

One launch per strategy and precision runs every check for masters off and on (tests/distributed/ddp_checks.py,
tests/distributed/fsdp2_checks.py: ModelParallelStrategy with fully_shard on Lightning's CPU device mesh); the
single-process references run here, in-process, on the same 32 samples with the whole global batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.distributed.common import CLIP, INJECT_AT, fit, load_ranks
from tests.distributed.launch import launch

PRECISIONS = ["16-mixed", "bf16-mixed"]
MASTERS = ["off", "on"]
_DTYPE = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


RUNS = [(strategy, precision) for strategy in ("ddp", "fsdp2") for precision in PRECISIONS]
_LAUNCHED: dict[tuple[str, str], Path] = {}


def _launched(strategy: str, precision: str, tmp_path_factory) -> tuple[str, Path]:
    """Launch tests/distributed/<strategy>_checks.py once per strategy and precision; (precision, output folder)."""
    if (strategy, precision) not in _LAUNCHED:
        out = tmp_path_factory.mktemp(f"{strategy}-{precision}")
        launch(f"{strategy}_checks.py", str(out), precision, timeout=240)
        _LAUNCHED[strategy, precision] = out
    return precision, _LAUNCHED[strategy, precision]


@pytest.fixture(scope="module", params=RUNS, ids=[f"{s}-{p}" for s, p in RUNS])
def launched(request, tmp_path_factory) -> tuple[str, Path]:
    return _launched(*request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=PRECISIONS)
def ddp_run(request, tmp_path_factory) -> tuple[str, Path]:
    return _launched("ddp", request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=PRECISIONS)
def fsdp2_run(request, tmp_path_factory) -> tuple[str, Path]:
    return _launched("fsdp2", request.param, tmp_path_factory)


_REFERENCES: dict[tuple[str, str], dict] = {}


def reference(precision: str, masters: str) -> dict:
    """One process, the whole global batch, same plugin settings (computed once per setting)."""
    if (precision, masters) not in _REFERENCES:
        _REFERENCES[precision, masters] = fit(precision, masters == "on", strategy="auto", devices=1)
    return _REFERENCES[precision, masters]


def _tolerance(precision: str) -> float:
    # weights are O(1); 8 clipped SGD steps whose half-precision rounding differs with the batch split
    return 0.5 * torch.finfo(_DTYPE[precision]).eps


@pytest.mark.parametrize("masters", MASTERS)
def test_two_ranks_with_half_batches_match_one_process_with_the_whole_batch(launched, masters):
    precision, out = launched
    ranks = load_ranks(out / masters)
    ref = reference(precision, masters)
    expected_dtype = _DTYPE[precision] if masters == "on" else torch.float32
    assert ranks[0]["full"]["param_dtype"] == ref["param_dtype"] == expected_dtype
    for name, value in ref["weights"].items():
        torch.testing.assert_close(ranks[0]["full"]["weights"][name], value, rtol=0, atol=_tolerance(precision))


@pytest.mark.parametrize("masters", MASTERS)
def test_inf_on_one_rank_makes_every_rank_skip_that_step_with_equal_scales(launched, masters):
    precision, out = launched
    rank0, rank1 = (ranks["full"] for ranks in load_ranks(out / masters))
    # (global step after the batch, scale, skipped steps so far), batch after batch, on each rank
    assert rank0["steps"] == rank1["steps"]
    counts = [0] + [count for _, _, count in rank0["steps"]]
    skipped = [step for step in range(len(rank0["steps"])) if counts[step + 1] > counts[step]]
    assert skipped == [INJECT_AT]
    assert rank0["steps"] == reference(precision, masters)["steps"]
    if precision == "16-mixed":
        assert rank0["steps"][INJECT_AT][1] == rank0["steps"][INJECT_AT - 1][1] / 2  # backed off once, everywhere
    assert rank0["scaler"] == rank1["scaler"]


@pytest.mark.parametrize("masters", MASTERS)
def test_a_fused_optimizer_skips_on_the_device_on_every_rank_without_a_host_sync(ddp_run, masters):
    # the found-inf flag is all-reduced as a device tensor and the fused SGD skips on it: rank 0's inf at step
    # INJECT_AT is skipped on both ranks, not one step's decision is read on the host, and the weights stay equal
    precision, out = ddp_run
    ranks = load_ranks(out / masters)
    for rank in ranks:
        assert rank["fused_step_syncs"] == [0] * 8
        assert rank["fused"]["scaler"]["skipped_steps"] == rank["full"]["scaler"]["skipped_steps"] == 1
        assert rank["fused"]["scaler"] == rank["full"]["scaler"]
    for name, value in ranks[0]["fused"]["weights"].items():
        assert torch.equal(ranks[1]["fused"]["weights"][name], value), name
        torch.testing.assert_close(value, ranks[0]["full"]["weights"][name], rtol=0, atol=_tolerance(precision))


@pytest.mark.parametrize("masters", MASTERS)
def test_weights_and_masters_are_bitwise_equal_across_ranks(launched, masters):
    _, out = launched
    rank0, rank1 = load_ranks(out / masters)
    runs = [name for name, result in rank0.items() if isinstance(result, dict)]
    assert {"full", "resumed", "accumulated"} <= set(runs)
    for run in runs:  # after fit the model holds the fp32 masters (when there are masters)
        for name, value in rank0[run]["weights"].items():
            assert torch.equal(value, rank1[run]["weights"][name]), (run, name)


@pytest.mark.parametrize("masters", MASTERS)
def test_gradient_accumulation_matches_the_large_batch_reference(launched, masters):
    """2 ranks x 2 micro-batches of 2 samples == 1 process x 8 samples per step (DDP reduces only the last one)."""
    precision, out = launched
    accumulated = load_ranks(out / masters)[0]["accumulated"]
    ref = reference(precision, masters)
    assert len(accumulated["norms"]) == len(ref["norms"])  # one record per optimizer step
    for name, value in ref["weights"].items():
        torch.testing.assert_close(accumulated["weights"][name], value, rtol=0, atol=_tolerance(precision))


@pytest.mark.parametrize("masters", MASTERS)
def test_norm_clipping_equals_single_process_clipping(launched, masters):
    precision, out = launched
    run = load_ranks(out / masters)[0]["full"]
    ref = reference(precision, masters)
    finite = [step for step, norm in enumerate(ref["norms"]) if math.isfinite(norm)]
    assert finite == [step for step, norm in enumerate(run["norms"]) if math.isfinite(norm)]
    assert all(ref["norms"][step] > CLIP for step in finite), "every step must clip for the test to mean anything"
    for step in finite:
        assert run["norms"][step] == pytest.approx(ref["norms"][step], rel=10 * torch.finfo(_DTYPE[precision]).eps)
        assert run["clipped"][step] == pytest.approx(ref["clipped"][step], rel=1e-5)
        assert run["clipped"][step] == pytest.approx(CLIP, rel=1e-5)


@pytest.mark.parametrize("masters", MASTERS)
def test_resumed_run_continues_as_the_uninterrupted_one(launched, masters):
    """Resumed on 2 ranks from the checkpoint written after epoch 0: same weights (bitwise), scaler, steps."""
    _, out = launched
    for rank in load_ranks(out / masters):
        full, resumed = rank["full"], rank["resumed"]
        assert resumed["steps"] == full["steps"][len(full["steps"]) - len(resumed["steps"]) :]
        assert resumed["scaler"] == full["scaler"]
        for name, value in full["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name


def test_fp32_reduction_of_master_gradients_matches_an_fp32_reduced_reference(ddp_run):
    """Masters: the gradient the optimizer sees is the fp32 mean of the ranks' half gradients, exactly; with
    reduce_dtype=bf16 it is that mean rounded to bf16."""
    precision, out = ddp_run
    rank0, rank1 = load_ranks(out / "on")
    scale = 1024.0 if precision == "16-mixed" else 1.0  # the first step's scale (a power of 2: unscaling is exact)
    for run, exact in (("full", True), ("bf16_reduce", False)):
        local0, local1 = rank0[run]["local_grads"], rank1[run]["local_grads"]
        fp32_mean = (local0.double() + local1.double()) / 2 / scale
        seen = rank0[run]["grads"].double()
        assert torch.equal(seen, rank1[run]["grads"].double())
        if exact:
            assert torch.equal(seen, fp32_mean)
        else:
            assert not torch.equal(seen, fp32_mean)
            # each rank's halved gradient is rounded to bf16, then their sum is: relative rounding 2**-8 each time
            magnitude = (local0.double().abs() + local1.double().abs()) / 2 / scale
            bound = 2.0**-8 * (magnitude + fp32_mean.abs()) + torch.finfo(torch.bfloat16).tiny
            assert bool(((seen - fp32_mean).abs() <= bound).all())


def test_no_per_step_warnings_from_the_scalers_tensors_on_sharded_gradients(fsdp2_run):
    """The scaler unscales DTensor gradients through their local shards: DTensor never sees its one-element
    tensors (it warned "non-scalar tensor with numel=1" on every rank at every step)."""
    _, out = fsdp2_run
    for masters in MASTERS:
        for rank in load_ranks(out / masters):
            for run_name in ("full", "resumed", "accumulated"):
                dtensor_warnings = [w for w in rank[run_name]["warnings"] if "DTensor" in w or "non-scalar" in w]
                assert dtensor_warnings == [], (masters, run_name)


def test_min_scale_error_names_the_culprit_from_the_rank_whose_shard_holds_it(fsdp2_run):
    """The inf is in rank 1's shard only; both ranks stop together, and rank 0's error names the parameter too."""
    precision, out = fsdp2_run
    errors = [rank["min_scale_error"] for rank in load_ranks(out / MASTERS[-1])]
    reason = "cannot back off below min_scale" if precision == "16-mixed" else "optimizer steps in a row"
    for error in errors:
        assert error is not None and reason in error
        assert "Non-finite gradients in: net.0.weight." in error


def test_fsdp2_run_resumed_from_a_full_single_file_checkpoint_continues_as_the_uninterrupted_one(fsdp2_run):
    """ModelParallelStrategy(save_distributed_checkpoint=False): one file, the plugin state written by rank 0."""
    _, out = fsdp2_run
    for rank in load_ranks(out / "on"):
        full, resumed = rank["full"], rank["resumed_from_file"]
        assert resumed["scaler"] == full["scaler"]
        assert resumed["steps"] == full["steps"][len(full["steps"]) - len(resumed["steps"]) :]
        for name, value in full["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name


def test_casting_policy_module_rule_composes_with_fsdp2_casting(fsdp2_run):
    """fp32_modules=['net.3'] with the head sharded on its own by plugin.fsdp2_policy('net.3', head): the head
    computes in fp32 with fp32 weights while the first layer computes in half, as on one device."""
    precision, out = fsdp2_run
    policy_run = load_ranks(out / "on")[0]["policy"]
    ref = fit(precision, True, strategy="auto", devices=1, policy={"fp32_modules": ["net.3"]})
    assert policy_run["head_dtypes"] == ref["head_dtypes"] == (torch.float32, torch.float32)
    assert policy_run["param_dtype"] == ref["param_dtype"] == _DTYPE[precision]
    for name, value in ref["weights"].items():
        torch.testing.assert_close(policy_run["weights"][name], value, rtol=0, atol=_tolerance(precision))


def test_fp32_module_left_in_a_half_fsdp2_group_is_refused_at_setup_naming_it(fsdp2_run):
    precision, out = fsdp2_run
    error = load_ranks(out / "on")[0]["policy_error"]
    assert error is not None
    dtype = _DTYPE[precision]
    assert f"net.3.weight ({dtype}, want torch.float32)" in error
    assert "plugin.fsdp2_policy(name, module)" in error


def test_ddp_spawn_with_masters_gives_the_ddp_run_weights(tmp_path_factory):
    """strategy='ddp_spawn' (processes started by Lightning from here): the weights that come back to this process
    are the fp32 masters of the 2-rank run, bitwise those of the same run under strategy='ddp' (bf16 only: one
    spawn run shows the mechanism, and fp16 on CPU is slow)."""
    precision, out = _launched("ddp", "bf16-mixed", tmp_path_factory)
    spawned = fit(precision, True, strategy="ddp_spawn")
    for name, value in load_ranks(out / "on")[0]["full"]["weights"].items():
        assert torch.equal(spawned["weights"][name], value), name


@pytest.mark.parametrize("masters", MASTERS)
def test_bf16_gradient_reduction_trains_like_the_reference_within_bf16_rounding(ddp_run, masters):
    """reduce_dtype=bf16 (DDP's buckets cast to bf16 without masters; the flat master gradients with them):
    same skipped step, weights within bf16's resolution of the fp32-reduced single-process run, not equal to it."""
    precision, out = ddp_run
    run = load_ranks(out / masters)[0]["bf16_reduce"]
    ref = reference(precision, masters)
    assert run["steps"] == ref["steps"]
    differences = [(run["weights"][name] - value).abs().max().item() for name, value in ref["weights"].items()]
    assert max(differences) > 0
    assert max(differences) <= torch.finfo(torch.bfloat16).eps


def test_fsdp2_norm_left_in_a_half_group_warns_once_at_setup_and_trains(fsdp2_run):
    precision, out = fsdp2_run
    run = load_ranks(out / "on")[0]["norm_in_half"]
    warned = [w for w in run["warnings"] if "normalisation-layer parameters compute in" in w]
    assert len(warned) == 1 and "net.1.weight" in warned[0]
    assert run["steps"] == reference(precision, "on")["steps"]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL process group)")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_world_size_one_on_cuda_matches_one_device(strategy, precision):
    """The DDP and FSDP2 paths on CUDA (NCCL, world size 1) with masters: the single-device result, same skips."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    from tests.distributed.common import shard_net

    parallel = "ddp" if strategy == "ddp" else ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    run = fit(
        precision,
        True,
        strategy=parallel,
        devices=1,
        accelerator="cuda",
        shard=shard_net if strategy == "fsdp2" else None,
    )
    ref = fit(precision, True, strategy="auto", devices=1, accelerator="cuda")
    assert run["steps"] == ref["steps"] and run["param_dtype"] == _DTYPE[precision]
    for name, value in ref["weights"].items():
        torch.testing.assert_close(run["weights"][name], value, rtol=0, atol=_tolerance(precision))


def test_plugin_still_pickles_after_a_distributed_run(launched):
    """The process-group references the plugin takes at setup do not stop a user from pickling it afterwards."""
    _, out = launched
    for masters in MASTERS:
        for rank in load_ranks(out / masters):
            assert rank["full"]["plugin_pickles"] is True


def test_a_users_ddp_comm_hook_with_master_weights_is_refused_at_setup(ddp_run):
    _, out = ddp_run
    error = load_ranks(out / "on")[0]["user_hook_error"]
    assert error is not None
    assert "DDPStrategy(ddp_comm_hook='allreduce_hook') cannot be combined" in error and "Drop ddp_comm_hook" in error
