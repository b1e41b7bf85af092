"""Lean master weights under FSDP2 (ModelParallelStrategy + fully_shard) on 2 real CPU processes (gloo): sharded bf16
parameters plus sharded int16 remainders, against one process with the whole global batch and against fp32 masters.
The 2-rank runs are tests/distributed/fsdp2_lean_checks.py (one launch for the module)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.distributed import sync_for
from lightning_mp.distributed.fsdp2_lean import ShardedRemainderMasters
from tests.distributed.common import CLIP, INJECT_AT, Net, fit, load_ranks
from tests.distributed.fsdp2_lean_checks import Wide8bit, WideRMSprop
from tests.distributed.launch import launch

_EPS = torch.finfo(torch.bfloat16).eps
RUNS = ("full", "resumed", "resumed_from_file", "accumulated", "accumulated_bf16", "policy", "norm_in_half")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    out: Path = tmp_path_factory.mktemp("fsdp2-lean")
    launch("fsdp2_lean_checks.py", str(out), timeout=400)
    return load_ranks(out), out


@pytest.fixture(scope="module")
def reference() -> dict:
    return {
        1: fit("bf16-mixed", "remainder", strategy="auto", devices=1),
        2: fit("bf16-mixed", "remainder", strategy="auto", devices=1, accumulate=2),
        "8bit": fit("bf16-mixed", "remainder", strategy="auto", devices=1, model_class=Wide8bit),
        "rmsprop": fit("bf16-mixed", "remainder", strategy="auto", devices=1, model_class=WideRMSprop),
    }


def test_two_ranks_match_one_process_with_the_whole_batch_and_fp32_masters(ranks, reference):
    """Computed in bf16 from bf16 shards; after fit the model holds the exact fp32 values. Gradients differ from one
    process by the order of their bf16 sums (reduced in fp32, rounded once), so weights agree to well within a bf16
    spacing, as fp32 masters under FSDP2 do."""
    (rank0, _), _ = ranks
    for run in RUNS:
        expected = reference[2 if run.startswith("accumulated") else 1]
        assert rank0[run]["param_dtype"] == torch.bfloat16, run
        for name, value in expected["weights"].items():
            assert rank0[run]["weights"][name].dtype == torch.float32
            torch.testing.assert_close(rank0[run]["weights"][name], value, rtol=0, atol=0.25 * _EPS, msg=run)
    for name, value in rank0["fp32_masters"]["weights"].items():
        torch.testing.assert_close(rank0["full"]["weights"][name], value, rtol=0, atol=0.25 * _EPS)


def test_ranks_agree_bitwise_and_skip_the_step_with_an_inf_in_one_ranks_shard(ranks, reference):
    (rank0, rank1), _ = ranks
    for run in (*RUNS, "replay_adamw", "replay_sgd", "rest", "validated"):
        for name, value in rank0[run]["weights"].items():
            assert torch.equal(value, rank1[run]["weights"][name]), (run, name)
    assert rank0["full"]["steps"] == rank1["full"]["steps"] == reference[1]["steps"]
    counts = [0] + [count for _, _, count in rank0["full"]["steps"]]
    assert [s for s in range(len(counts) - 1) if counts[s + 1] > counts[s]] == [INJECT_AT]


def test_every_step_clips_by_a_norm_equal_to_one_processes(ranks, reference):
    """Clipping is applied inside the step (the bf16 gradient shards keep their values), so its effect shows in the
    weights (matched above); here: it is active at every finite step and the gradient norm matches one process."""
    (rank0, _), _ = ranks
    ref = reference[1]
    finite = [step for step, norm in enumerate(ref["norms"]) if math.isfinite(norm)]
    assert finite == [step for step, norm in enumerate(rank0["full"]["norms"]) if math.isfinite(norm)]
    assert len(finite) == len(ref["norms"]) - 1  # the injected inf
    for step in finite:
        assert ref["norms"][step] > CLIP
        assert rank0["full"]["norms"][step] == pytest.approx(ref["norms"][step], rel=10 * _EPS)


@pytest.mark.parametrize("run", ["resumed", "resumed_from_file"])
def test_resume_from_a_distributed_or_full_checkpoint_continues_bit_exactly(ranks, run):
    for rank in ranks[0]:
        full, resumed = rank["full"], rank[run]
        assert resumed["steps"] == full["steps"][len(full["steps"]) - len(resumed["steps"]) :]
        for name, value in full["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name


def test_a_full_checkpoint_holds_fp32_weights_that_load_strictly_into_an_fp32_model(ranks):
    _, out = ranks
    checkpoint = torch.load(out / "ckpt-file" / "epoch=0.ckpt", weights_only=False)
    state = checkpoint["state_dict"]
    assert all(value.dtype == torch.float32 for value in state.values())
    # the remainders are in: the converted weights are not all bf16 values (their low 16 bits are not all zero)
    low_bits = state["net.0.weight"].view(torch.int32) & 0xFFFF
    assert bool(low_bits.any())
    model = Net()
    model.load_state_dict(state, strict=True)


def test_a_distributed_checkpoint_consolidates_to_the_same_fp32_weights_as_the_full_one(ranks, tmp_path):
    """The two checkpoints of the same run after epoch 0: the sharded one's fp32 shards, consolidated in one process,
    equal the full file's fp32 tensors bit for bit."""
    from lightning_mp.cli.consolidate import consolidate

    _, out = ranks
    consolidated = consolidate(out / "ckpt" / "epoch=0.ckpt", tmp_path / "model.pt")
    full = torch.load(out / "ckpt-file" / "epoch=0.ckpt", weights_only=False)["state_dict"]
    assert sorted(consolidated) == sorted(full)
    for name, value in full.items():
        assert consolidated[name].dtype == torch.float32 and torch.equal(consolidated[name], value), name


def test_validate_after_fit_splits_again_and_leaves_the_exact_weights(ranks):
    for rank in ranks[0]:
        record = rank["validated"]
        for name, value in record["before"].items():
            assert value.dtype == torch.float32 and torch.equal(record["after"][name], value), name
    assert ranks[0][0]["validated"]["val_loss"] == ranks[0][1]["validated"]["val_loss"]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "nadam"])
def test_each_ranks_steps_equal_torchs_fused_optimizer_on_fp32_shards_bitwise(ranks, optimizer):
    """The gradients each rank's step saw (bf16 shards; fp32 for the norm, kept fp32 without remainder), replayed on
    fp32 copies of the exact initial shards with torch's fused optimizer, give the exact final shards bit for bit.
    At the second step the store followed the same optimizers again (``follow_optimizers``): the steps are unchanged
    and the optimizer's load hooks are registered once (a kept optimizer is not attached twice)."""
    for rank in ranks[0]:
        record = rank[f"replay_{optimizer}"]
        before, after = record["load_hooks"]
        assert before == after and before[0] >= 1, record["load_hooks"]
        assert len(record["seen"]) == 8
        dtypes = [g.dtype for g in record["seen"][0]]
        assert dtypes == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.bfloat16]
        params = [torch.nn.Parameter(value.clone()) for value in record["initial"]]
        if optimizer == "adamw":
            reference = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
        elif optimizer == "nadam":  # no fused NAdam in torch: its foreach implementation, as on one device
            reference = torch.optim.NAdam(params, lr=1e-2, weight_decay=0.1, foreach=True)
        else:
            reference = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
        for grads in record["seen"]:
            for param, grad in zip(params, grads):
                param.grad = grad.float()
            reference.step()
        for param, final in zip(params, record["final"]):
            assert torch.equal(param.detach(), final)


def test_at_rest_each_rank_holds_bf16_shards_int16_remainders_and_no_fp32_copy(ranks):
    """Counted from live tensors at the second step, before the optimizer (gradients present): 2 (bf16 shard, a view
    of FSDP2's own storage) + 2 (remainder) + 2 (bf16 gradient shard) + 8 (AdamW's fp32 moments) bytes per local
    element; no live fp32 tensor equals any shard's exact fp32 value."""
    for rank in ranks[0]:
        rest = rank["rest"]["rest"]
        assert rest["shard_dtypes"] == {torch.bfloat16} and rest["kept_dtypes"] == {torch.float32}
        assert rest["grad_dtypes"] == {("DTensor", torch.bfloat16)}
        assert rest["fsdp_storage"]
        assert rest["fp32_copies_of_shards"] == 0
        numel = rest["local_numel"]
        assert rest["shard_bytes"] == rest["remainder_bytes"] == 2 * numel
        assert rest["state_bytes"] == 8 * numel
        # gradients: FSDP2's reduce-scatter output, one bf16 buffer of the padded shards (57 elements on both ranks)
        assert rest["grad_bytes"] == 2 * 57


def test_fp32_accumulation_sums_the_micro_batches_in_fp32(ranks):
    (rank0, _), _ = ranks
    assert rank0["accumulated"]["grad_dtype"] == torch.float32
    assert rank0["accumulated_bf16"]["grad_dtype"] == torch.bfloat16


def test_kept_fp32_modules_stay_fp32_shards_and_a_norm_in_the_bf16_group_warns(ranks):
    (rank0, _), _ = ranks
    assert rank0["policy"]["head_dtypes"] == (torch.float32, torch.float32)  # fp32_modules=['net.3'], own group
    assert rank0["full"]["norm_dtype"] == torch.float32
    assert rank0["norm_in_half"]["norm_dtype"] == torch.bfloat16
    assert any("normalisation-layer parameters compute in" in w for w in rank0["norm_in_half"]["warnings"])


def test_fp8_tensorwise_all_gather_is_refused_at_setup_and_rowwise_trains(ranks):
    (rank0, rank1), _ = ranks
    error = rank0["fp8"]["tensorwise"]["error"]
    assert "cannot split the shard of net.0.weight" in error and "fp8='rowwise'" in error
    assert "master_weights=True" in error and rank1["fp8"]["tensorwise"]["error"] == error
    rowwise = rank0["fp8"]["rowwise"]
    assert rowwise["store"] == "ShardedRemainderMasters" and all(math.isfinite(loss) for loss in rowwise["losses"])
    for name, value in rowwise["weights"].items():
        assert value.dtype == torch.float32 and torch.equal(value, rank1["fp8"]["rowwise"]["weights"][name]), name
        # AdamW (lr 2e-2) moves each element by about lr per step whatever its gradient's size, so an element whose
        # gradient is near zero may follow a one-ulp difference of the forward (fp8 casts, the bf16 rounding of
        # ties); nearly all elements match to half a bf16 spacing
        difference = (value - rank0["fp8"]["rowwise_fp32_masters"]["weights"][name]).abs()
        assert (difference <= 0.5 * _EPS).float().mean() >= 0.99, name
        assert difference.max() <= 4 * 2e-2, name


def test_fsdp2_gives_lean_masters_a_sharded_store_and_the_generic_path_needs_sharded_parameters():
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False)
    strategy.parallel_devices = [torch.device("cpu")]
    sync = sync_for(strategy, plugin)
    assert not sync.owns_masters
    sharded = sync.adopt(plugin.masters)
    assert isinstance(sharded, ShardedRemainderMasters) and sync.adopt(sharded) is sharded
    assert sharded.whole_checkpoints  # read by the generic path: quantised state is refused for whole files
    assert sync_for(None, plugin).adopt(sharded) is plugin.masters  # one device again: the plugin's own store
    sharded._module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adagrad(sharded._module.parameters())
    with pytest.raises(ValueError, match=r"Adagrad.*sharded by fully_shard.*param_groups\[0\]\['params'\]\[0\]"):
        sharded.attach([optimizer])
    dampened = torch.optim.SGD(sharded._module.parameters(), lr=0.1, momentum=0.9, dampening=0.1)
    with pytest.raises(ValueError, match=r"SGD with dampening"):
        sharded.attach([dampened])


#: torchao's AdamW8bit (in one pass on the local shards: ShardedAdam8bitStep) and RMSprop (the generic path)
OTHERS = ("8bit", "rmsprop")
STEPS = {"8bit": "ShardedAdam8bitStep", "rmsprop": "ShardedGenericStep"}


@pytest.mark.parametrize("name", OTHERS)
def test_8bit_and_generic_path_train_ranks_agree_and_both_skip_an_inf_in_one_ranks_shard(ranks, reference, name):
    """torchao AdamW8bit in one pass on the local shards, and RMSprop(foreach=False) through the generic path on
    DTensor proxies of the shards: both ranks end with the same fp32 weights, skip the step whose gradient had an inf
    on rank 0 only, and match one process with the whole batch as far as bf16 gradients allow: the gradients differ
    by the order of their bf16 sums (one bf16 rounding), and these adaptive optimizers move an element whose gradient
    is near zero by about lr per step whatever its size, so a few elements follow a one-ulp gradient difference
    (measured: max 0.020 (AdamW8bit, lr 1e-2) and 0.039 (RMSprop, momentum 0.5); 99.2% / 99.7% of the 8897 values
    within a quarter of a bf16 spacing). The exact check is the replay below (bitwise)."""
    (rank0, rank1), _ = ranks
    run0, run1 = rank0["generic"][name], rank1["generic"][name]
    assert run0["step_kind"] == run1["step_kind"] == STEPS[name]
    for key, value in run0["weights"].items():
        assert value.dtype == torch.float32 and torch.equal(value, run1["weights"][key]), key
    assert run0["steps"] == run1["steps"] == reference[name]["steps"]
    counts = [0] + [count for _, _, count in run0["steps"]]
    assert [s for s in range(len(counts) - 1) if counts[s + 1] > counts[s]] == [INJECT_AT]
    finite = [math.isfinite(norm) for norm in reference[name]["norms"]]
    assert [math.isfinite(norm) for norm in run0["norms"]] == finite and finite.count(False) == 1
    for norm, expected_norm in zip(run0["norms"], reference[name]["norms"]):  # clipped at every finite step
        if math.isfinite(expected_norm):
            assert norm > CLIP and norm == pytest.approx(expected_norm, rel=10 * _EPS)
    expected = reference[name]["weights"]
    gaps = torch.cat([(run0["weights"][key] - value).abs().reshape(-1) for key, value in expected.items()])
    assert (gaps <= 0.25 * _EPS).float().mean() >= 0.99
    lr_per_step = 1e-2 if name == "8bit" else 2 * 1e-3 * 10  # RMSprop's first steps: lr * g / sqrt(0.01 g^2)
    assert gaps.max() <= 2 * len(run0["steps"]) * lr_per_step


@pytest.mark.parametrize("run", ["8bit_resumed", "rmsprop_resumed", "rmsprop_from_file"])
def test_8bit_and_generic_path_resume_from_a_checkpoint_bit_exactly(ranks, run):
    """Distributed checkpoints hold each rank's shard of the optimizer's DTensor state (torchao's quantised states
    included, keyed by the model's parameters) under the model's parameter names; RMSprop's plain state also goes
    through a whole-file checkpoint."""
    for rank in ranks[0]:
        full, resumed = rank["generic"][run.split("_")[0]], rank["generic"][run]
        assert resumed["step_kind"] == STEPS[run.split("_")[0]]
        assert len(resumed["steps"]) == 4 and resumed["steps"] == full["steps"][-4:]
        for name, value in full["weights"].items():
            assert torch.equal(resumed["weights"][name], value), name


def test_state_a_checkpoint_would_save_wrongly_is_refused_8bit_at_setup(ranks):
    """Quantised (tensor-subclass) state with whole-file checkpoints: refused at setup, before any step, by the
    one-pass 8-bit step; after the first step by the generic path (AdamW8bit without kernels). Per-parameter state
    that is not sharded like its parameter (plain tensors of the local shard's shape): refused after the first step.
    On every rank."""
    for rank in ranks[0]:
        error = rank["generic"]["local_state"]["error"]
        assert "LocalMomentum's state 'buffer' is a plain tensor of shape (32, 4)" in error
        assert "master_weights=True under FSDP2" in error
        for run, steps in (("8bit_from_file", 0), ("8bit_generic_from_file", 1)):
            refused = rank["generic"][run]
            assert refused["steps"] == steps, run
            error = refused["error"]
            assert "save_distributed_checkpoint=False" in error and "OptimState8bit" in error
            assert "Keep save_distributed_checkpoint=True" in error


@pytest.mark.parametrize("how", ["reset", "load", "lr"])
def test_8bit_edits_between_steps_are_followed_bitwise_on_the_local_shards(ranks, how):
    """torchao's AdamW8bit in one pass under FSDP2, its state edited between steps (a layer's state emptied, an
    earlier ``state_dict`` loaded back, the lr tensors filled): each rank ends bitwise where the same run ends with
    the step's layouts made again before every backward, and the ranks agree; each edit changed the run."""
    for rank in (rank["generic"] for rank in ranks[0]):
        edited, rebuilt = rank[f"8bit_edit_{how}"], rank[f"8bit_edit_{how}_rebuilt"]
        for name, value in rebuilt["weights"].items():
            assert torch.equal(edited["weights"][name].view(torch.int32), value.view(torch.int32)), name
        others = [rank[f"8bit_edit_{other}"] for other in ("reset", "load", "lr") if other != how]
        assert all(
            any(not torch.equal(edited["weights"][n], other["weights"][n]) for n in edited["weights"])
            for other in others
        )
    first, second = (rank["generic"][f"8bit_edit_{how}"]["weights"] for rank in ranks[0])
    assert all(torch.equal(first[name], second[name]) for name in first)  # whole weights: the same on both ranks


@pytest.mark.parametrize("name", ["8bit", "adam8bit", "8bit_generic", "rmsprop"])
def test_8bit_and_generic_path_steps_equal_the_optimizer_on_fp32_shards_bitwise(ranks, name):
    """Each rank's gradients (bf16 shards; fp32 for the norm), replayed with the same optimizer on plain fp32 copies
    of the exact initial shards, give the exact final shards bit for bit (torchao quantises each local shard):
    torchao's AdamW8bit and Adam8bit in one pass, AdamW8bit on the generic path (no kernels), RMSprop."""
    kinds = {"8bit": "ShardedAdam8bitStep", "adam8bit": "ShardedAdam8bitStep", "8bit_generic": "ShardedGenericStep"}
    for rank in ranks[0]:
        record = rank["generic"][f"{name}_replay"]
        assert record["step_kind"] == kinds.get(name, "ShardedGenericStep")
        assert len(record["seen"]) == 8
        params = [torch.nn.Parameter(value.clone()) for value in record["initial"]]
        if name in ("8bit", "8bit_generic"):
            from torchao.optim import AdamW8bit

            reference = AdamW8bit(params, lr=1e-2, weight_decay=0.1)
        elif name == "adam8bit":
            from torchao.optim import Adam8bit

            reference = Adam8bit(params, lr=1e-2, weight_decay=0.1)
        else:
            reference = torch.optim.RMSprop(params, lr=1e-3, momentum=0.5, foreach=False)
        for grads in record["seen"]:
            for param, grad in zip(params, grads):
                param.grad = grad.float()
            reference.step()
        for param, final in zip(params, record["final"]):
            assert torch.equal(param.detach(), final)


@pytest.mark.parametrize("name", OTHERS)
def test_8bit_and_generic_path_at_rest_hold_the_optimizers_own_sharded_state_and_no_fp32_copy(ranks, name):
    """At the second step, before the optimizer: the state is DTensors (AdamW8bit: 8-bit codes for the 64x64 local
    shard, which torchao quantises from 4096 values; fp32 for the rest) keyed by the model's parameters (one-pass) or
    by proxies each holding a one-element placeholder (generic path), and no live fp32 tensor equals any shard's
    exact value."""
    for rank in ranks[0]:
        rest = rank["generic"][name]["rest"]
        assert rest["fp32_copies_of_shards"] == 0
        numel = rest["local_numel"]
        if name == "8bit":
            assert rest["keyed_by_params"]
            assert rest["state_kinds"] == {("DTensor", "Tensor"), ("DTensor", "OptimState8bit")}
            quantised = 64 * 64  # 2 states x (1-byte codes + an fp32 scale per 256 values + a 256-entry fp32 map)
            expected = 2 * (quantised + 4 * quantised // 256 + 4 * 256) + 8 * (numel - quantised)
        else:
            assert not rest["keyed_by_params"] and rest["proxy_bytes"] == 4 * 8  # 8 parameters
            assert rest["state_kinds"] == {("DTensor", "Tensor")}
            expected = 8 * numel  # square_avg and momentum_buffer, fp32
        assert rest["state_bytes"] == expected
