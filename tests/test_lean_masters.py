"""Lean master weights (``master_weights="remainder"``): bf16 weight + 16-bit remainder = the fp32 master, exactly.

References: the bit split against the fp32 bit patterns themselves; the fused step against torch's own optimizer
with ``fused=True`` on fp32 parameters holding the same values and given the same gradients; the generic path
against the same optimizer on fp32 parameters; a Trainer run against a replay of its gradients on fp32 parameters.
"""

from __future__ import annotations

import copy
import struct

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.kernels.bits import join_fp32, split_fp32
from lightning_mp.master import MasterWeights, RemainderMasters, masters_for
from tests.helpers import generic_adamw8bit, seeded


# ---------------------------------------------------------------------- the bit split
def _f32(bits: int) -> torch.Tensor:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32)


@settings(max_examples=1000, deadline=None)
@given(st.integers(min_value=0, max_value=2**32 - 1))
@example(0x00000000)  # +0
@example(0x80000000)  # -0
@example(0x00000001)  # smallest subnormal
@example(0x807FFFFF)  # largest negative subnormal
@example(0x7F7FFFFF)  # largest finite: rounds to a bf16 infinity, joins back exactly
@example(0xFF7FFFFF)
@example(0x7F800000)  # +inf
@example(0xFF800000)  # -inf
@example(0x3F808000)  # exact tie (low half 0x8000)
@example(0xBF818000)  # negative tie
@example(0x3F807FFF)  # just below a tie
@example(0x7FFF8000)  # NaN whose rounding would carry into the sign bit
@example(0xFFFFFFFF)  # NaN whose rounding would wrap to +0
@example(0x7F800001)  # NaN with its mantissa bits in the low half only
def test_split_then_join_is_bit_exact_for_every_non_nan_pattern(bits):
    value = _f32(bits)
    high, low = split_fp32(value)
    joined = join_fp32(high, low)
    assert high.dtype == torch.bfloat16 and low.dtype == torch.int16
    if torch.isnan(value).item():
        assert torch.isnan(high).item() and torch.isnan(joined).item()  # the forward sees a NaN, never 0 or inf
        return
    assert joined.view(torch.int32).item() == value.view(torch.int32).item()
    # the high half is the nearest bf16 (ties away from zero); round-to-nearest-even agrees except on exact ties
    nearest = value.to(torch.bfloat16)
    if bits & 0xFFFF != 0x8000:
        assert high.view(torch.int16).item() == nearest.view(torch.int16).item()
    else:
        magnitude = abs(value.double().item())
        assert abs(high.double().item()) >= magnitude or not torch.isfinite(high).item()


def test_split_matches_python_struct_on_a_million_random_patterns():
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    value = bits.view(torch.float32)
    high, low = split_fp32(value)
    keep = ~torch.isnan(value)
    assert torch.equal(join_fp32(high, low).view(torch.int32)[keep], bits[keep])
    assert torch.equal(low, bits.to(torch.int16))  # the remainder is the low 16 bits, read as signed
    assert struct.unpack("<f", struct.pack("<i", int(bits[7])))[0] == pytest.approx(float(value[7]), nan_ok=True)


# ---------------------------------------------------------------------- the fused step, hand-made gradients
def _mlp(width=333):
    return nn.Sequential(nn.Linear(300, width), nn.LayerNorm(width), nn.Linear(width, 7))


def _lean(model, optimizer_cls, kwargs, chunk_size=32768):
    store = RemainderMasters(chunk_size=chunk_size)
    store.convert(model)
    optimizer = optimizer_cls(model.parameters(), **kwargs)
    store.attach([optimizer])
    return store, optimizer


def _exact(store, param):
    return store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()


def _same_grads(model, reference, generator, zero_some=False):
    for index, (param, ref) in enumerate(zip(model.parameters(), reference.parameters())):
        grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        if zero_some and index == 0:
            grad[:5] = 0.0
        param.grad, ref.grad = grad, grad.to(torch.float32, copy=True)  # not shared: clipping writes in place


FUSED_CASES = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, amsgrad=True, betas=(0.8, 0.9))),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1, maximize=True)),
    (torch.optim.Adam, dict(lr=1e-3, decoupled_weight_decay=True, weight_decay=0.05)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1)),
    (torch.optim.SGD, dict(lr=1e-2)),
]


@pytest.mark.parametrize("chunk_size", [32768, 1 << 20])
@pytest.mark.parametrize(("optimizer_cls", "kwargs"), FUSED_CASES)
def test_fused_step_equals_torchs_fused_optimizer_on_fp32_masters_bitwise(optimizer_cls, kwargs, chunk_size):
    """chunk_size 32768 cuts the 99900-element weight into pieces and puts several tensors in one chunk."""
    with seeded():
        model = _mlp()
    reference = copy.deepcopy(model)
    store, optimizer = _lean(model, optimizer_cls, kwargs, chunk_size)
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)  # the lean store starts from the exact fp32 values
    ref_optimizer = optimizer_cls(reference.parameters(), **kwargs, fused=True)
    generator = torch.Generator().manual_seed(1)
    for _ in range(4):
        _same_grads(model, reference, generator)
        store.fused_step(optimizer, None)
        ref_optimizer.step()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)
    state, ref_state = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for index in ref_state:
        for key, value in ref_state[index].items():
            assert torch.equal(state[index][key], value), (index, key)


def test_found_inf_makes_the_step_a_no_op_on_the_device():
    with seeded():
        model = _mlp(64)
    reference = copy.deepcopy(model)
    store, optimizer = _lean(model, torch.optim.AdamW, dict(lr=1e-2))
    generator = torch.Generator().manual_seed(2)
    _same_grads(model, reference, generator)
    store.fused_step(optimizer, None)  # state exists
    before = [_exact(store, p).clone() for p in model.parameters()]
    remainders = [low.clone() for _, low in store.flat_buffers]
    state = copy.deepcopy(optimizer.state_dict()["state"])
    _same_grads(model, reference, generator)
    store.fused_step(optimizer, torch.ones(1, dtype=torch.float32))  # the scaler's flag has one element
    assert all(torch.equal(_exact(store, p), b) for p, b in zip(model.parameters(), before))
    assert all(torch.equal(low, saved) for (_, low), saved in zip(store.flat_buffers, remainders))
    after = optimizer.state_dict()["state"]
    for index in state:
        for key in state[index]:
            assert torch.equal(after[index][key], state[index][key]), (index, key)
    store.fused_step(optimizer, torch.zeros((), dtype=torch.float32))  # a zero flag steps
    assert not torch.equal(_exact(store, next(model.parameters())), before[0])


@pytest.mark.parametrize("in_place", [True, False], ids=["kernel-updates-fp32-params", "torchs-kernel-on-fp32-params"])
def test_clipping_inside_the_step_equals_clipping_fp32_gradients(in_place, monkeypatch):
    """Every path that updates a parameter kept in fp32 clips it: the CPU kernel in place (the default), and torch's
    fused kernel after an in-place clip where the kernel does not take them (sharded under FSDP2, on a GPU: forced
    here by declining the in-place pieces)."""
    from lightning_mp.master.lean import plan

    if not in_place:
        monkeypatch.setattr(plan, "_in_place", lambda param: False)
    with seeded():
        model = _mlp(64)
    reference = copy.deepcopy(model)
    store, optimizer = _lean(model, torch.optim.AdamW, dict(lr=1e-2))
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    generator = torch.Generator().manual_seed(3)
    for clip in ("norm", "value"):
        _same_grads(model, reference, generator)
        if clip == "norm":
            total = store.clip_grad_norm_(optimizer, 0.3)
            assert torch.equal(total, torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.3))
        else:
            store.clip_grad_value_(optimizer, 0.01)
            torch.nn.utils.clip_grad_value_(list(reference.parameters()), 0.01)
        store.fused_step(optimizer, None)
        ref_optimizer.step()
        for param, ref in zip(model.parameters(), reference.parameters()):
            assert torch.equal(_exact(store, param), ref), clip


# ---------------------------------------------------------------------- the generic path
class SubclassedAdamW(torch.optim.AdamW):
    """Not exactly torch.optim.AdamW, so it takes the generic path."""


def _generic_case(make, chunk_size, steps=3, width=333):
    with seeded():
        model = _mlp(width)
    reference = copy.deepcopy(model)
    store = RemainderMasters(chunk_size=chunk_size)
    store.convert(model)
    optimizer = make(model.parameters())
    store.attach([optimizer])
    ref_optimizer = make(reference.parameters())
    generator = torch.Generator().manual_seed(4)
    for _ in range(steps):
        _same_grads(model, reference, generator)
        store.fused_step(optimizer, None)
        ref_optimizer.step()
    return store, model, reference, optimizer


@pytest.mark.parametrize("foreach", [False, True])
def test_generic_path_on_sliced_parameters_equals_the_optimizer_on_fp32(foreach):
    store, model, reference, optimizer = _generic_case(
        lambda ps: SubclassedAdamW(ps, lr=1e-2, weight_decay=0.1, foreach=foreach), chunk_size=32768
    )
    assert len(store.updates.of(optimizer).generic.slices[0][0:4]) == 4  # the 300x333 weight is cut into row blocks
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)
    assert all(p.dtype == torch.bfloat16 or p.dim() == 1 for p in optimizer.param_groups[0]["params"])


def test_torchao_8bit_and_4bit_adamw_run_exactly_with_their_small_state(monkeypatch):
    torchao_optim = pytest.importorskip("torchao.optim")
    # torchao compiles its per-parameter step (a minute of CPU here); eager runs the same function, for both sides
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    # (AdamW8bit itself takes the one-pass 8-bit step, tests/test_eightbit_step.py: a subclass keeps the generic path)
    for make, state_type in ((generic_adamw8bit, "OptimState8bit"), (torchao_optim.AdamW4bit, "OptimState4bit")):
        store, model, reference, optimizer = _generic_case(
            lambda ps, make=make: make(ps, lr=1e-2), chunk_size=1 << 20, steps=2, width=256
        )
        for param, ref in zip(model.parameters(), reference.parameters()):
            assert torch.equal(_exact(store, param), ref), state_type
        weight_state = next(iter(optimizer.state.values()))  # the 256x300 weight's proxy
        assert type(weight_state["exp_avg"]).__name__ == state_type
        assert weight_state["exp_avg"].shape == (256, 300)


def test_torchao_8bit_state_stays_8bit_and_exact_on_sliced_parameters(monkeypatch):
    # a 512x172 weight is cut into row blocks at chunk_size 32768: 190 rows (32680 elements, not a multiple of
    # torchao's 256-element blocks, which gave fp32 state) are trimmed to 128 rows (22016 = 86 blocks)
    torchao_optim = pytest.importorskip("torchao.optim")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    with seeded():
        model = nn.Sequential(nn.Linear(172, 512), nn.Linear(512, 8))
    reference = copy.deepcopy(model)
    store = RemainderMasters(chunk_size=32768)
    store.convert(model)
    optimizer = generic_adamw8bit(model.parameters(), lr=1e-2, weight_decay=0.1)  # the generic path, on purpose
    store.attach([optimizer])
    ref_optimizer = torchao_optim.AdamW8bit(reference.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        _same_grads(model, reference, generator)
        store.fused_step(optimizer, None)
        ref_optimizer.step()
    slices = store.updates.of(optimizer).generic.slices[0]
    weight_slices = [s for s in slices if s.param is model[0].weight]
    assert [s.shape for s in weight_slices] == [(128, 172)] * 4
    for s in weight_slices:
        assert type(optimizer.state[s.proxy]["exp_avg"]).__name__ == "OptimState8bit"
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)


@pytest.mark.parametrize("kahan_sum", [False, True])
def test_torch_optimi_adamw_runs_exactly_on_slices(kahan_sum):
    optimi = pytest.importorskip("optimi")
    store, model, reference, _ = _generic_case(
        lambda ps: optimi.AdamW(ps, lr=1e-2, weight_decay=1e-2, kahan_sum=kahan_sum), chunk_size=32768
    )
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)


def test_generic_optimizer_state_dict_round_trips_through_the_proxies():
    store, model, _, optimizer = _generic_case(lambda ps: SubclassedAdamW(ps, lr=1e-2), chunk_size=32768, steps=1)
    saved = optimizer.state_dict()
    assert len(saved["state"]) == sum(len(s) for s in store.updates.of(optimizer).generic.slices)
    assert optimizer.param_groups[0]["params"][0] is next(model.parameters())  # model params back after the call
    first = saved["state"][0]["exp_avg"].clone()
    optimizer.load_state_dict(saved)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], first)


# ---------------------------------------------------------------------- options
def test_remainder_with_fp16_is_refused_saying_why_and_what_to_use():
    with pytest.raises(ValueError, match=r"fp16 value is not.*master_weights=True.*bf16-mixed"):
        MixedPrecisionPlugin("16-mixed", master_weights="remainder")


@pytest.mark.parametrize(
    "bad",
    [
        "yes",
        1,
        {"kind": "remainder", "chunk": 4},
        {"kind": "remainder", "chunk_size": 1000},
        {"kind": "remainder", "accumulate_grads_in": "fp16"},
        {"kind": "other"},
    ],
)
def test_bad_master_weights_values_are_refused_by_name(bad):
    with pytest.raises(ValueError, match="master_weights|chunk_size|accumulate_grads_in"):
        MixedPrecisionPlugin("bf16-mixed", master_weights=bad)


def test_master_weights_values_pick_their_store():
    assert masters_for(torch.bfloat16, False) is None
    assert type(masters_for(torch.bfloat16, True)) is MasterWeights
    assert type(masters_for(torch.bfloat16, "fp32")) is MasterWeights
    lean = masters_for(torch.bfloat16, {"kind": "remainder", "accumulate_grads_in": "bf16", "chunk_size": 65536})
    assert isinstance(lean, RemainderMasters)
    assert lean.accumulate_grads_in == torch.bfloat16 and lean.chunk_size == 65536


def test_compiled_join_and_split_give_the_same_bits():
    """``compile=True`` compiles only the bit split; the update is torch's fused kernel either way."""
    with seeded():
        model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 5))
    reference = copy.deepcopy(model)
    store = RemainderMasters(chunk_size=32768, compile=True)
    store.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    store.attach([optimizer])
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        _same_grads(model, reference, generator)
        store.fused_step(optimizer, None)
        ref_optimizer.step()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("optimizer_cls", "kwargs"), FUSED_CASES[:1] + FUSED_CASES[4:5])
def test_fused_step_on_cuda_equals_torchs_fused_optimizer_bitwise(optimizer_cls, kwargs, monkeypatch):
    """The chunked path (torch's own kernel on joined chunks; the one-pass Triton kernel is tested in
    test_onepass.py against a stated bound)."""
    monkeypatch.setenv("LIGHTNING_MP_NATIVE", "0")
    with seeded():
        model = _mlp()
    reference = copy.deepcopy(model).cuda()
    model.cuda()
    store, optimizer = _lean(model, optimizer_cls, kwargs)
    ref_optimizer = optimizer_cls(reference.parameters(), **kwargs, fused=True)
    generator = torch.Generator().manual_seed(7)
    for _ in range(3):
        for param, ref in zip(model.parameters(), reference.parameters()):
            grad = torch.randn(param.shape, generator=generator).to("cuda", param.dtype)
            param.grad, ref.grad = grad, grad.float()
        store.fused_step(optimizer, torch.zeros((), device="cuda"))
        ref_optimizer.step()
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)


def test_an_optimizer_parameter_outside_the_model_is_refused_naming_its_place():
    from lightning_mp.master.lean.store import RemainderMasters

    masters = RemainderMasters()
    net = masters.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    stray = torch.nn.Parameter(torch.zeros(3, 2))
    optimizer = torch.optim.AdamW([{"params": list(net.parameters())}, {"params": [stray]}])
    with pytest.raises(ValueError) as refused:
        masters.attach([optimizer])
    message = str(refused.value)
    assert "optimizer 0 (AdamW) param_groups[1]['params'][0] (shape (3, 2), torch.float32)" in message
    assert "is not one of its parameters" in message and "self.parameters()" in message


def test_the_plugin_names_lean_masters_as_remainder_not_true():
    # what the CLI prints as "running ... with MixedPrecisionPlugin(...)": lean masters are not fp32 masters
    assert "master_weights='remainder'," in repr(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"))
    assert "master_weights=True," in repr(MixedPrecisionPlugin("bf16-mixed", master_weights=True))
    assert "master_weights=False," in repr(MixedPrecisionPlugin("bf16-mixed"))


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_following_the_same_optimizers_again_registers_their_load_hooks_once(optimizer):
    """``attach`` again, or ``follow_optimizers`` with the optimizers already attached (the Trainer's list set again
    mid-fit): the hooks that keep a loaded state fp32 stay one pair per optimizer (FSDP2's store: its 2-rank replay,
    tests/test_lean_masters_fsdp2.py)."""
    if optimizer == "adamw8bit":
        torchao_optim = pytest.importorskip("torchao.optim")
        from tests.optimizer_edits import eight_bit_runs

        if not eight_bit_runs():  # the generic path keys its state by proxies: no such hooks
            pytest.skip("the 8-bit one-pass kernel is not built here (no C compiler)")
    with seeded():
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    store = RemainderMasters()
    store.convert(model)
    made = torchao_optim.AdamW8bit if optimizer == "adamw8bit" else torch.optim.AdamW
    opt = made(model.parameters(), lr=1e-3)
    store.attach([opt])

    def hooks():
        return len(opt._optimizer_load_state_dict_pre_hooks), len(opt._optimizer_load_state_dict_post_hooks)

    once = hooks()
    assert once[0] >= 1 and once[1] >= 1
    store.attach([opt])
    store.follow_optimizers([opt])
    assert hooks() == once
