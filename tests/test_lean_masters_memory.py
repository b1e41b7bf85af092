"""Lean masters' memory mechanisms: blocks built at convert and released at restore, one at a time, and the device
move between convert and attach.

The bound checked here is on live tensors (every plain CPU storage reachable by the garbage collector, each once),
computed at each split into a block and at each release of one: the model never exists twice. Peak heap figures on a
real model are in benchmarks/decoder.py (benchmarks/RESULTS.md), not here.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn

import lightning_mp.master.lean.blocks as blocks
import lightning_mp.master.lean.store as remainder
from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean.blocks import BLOCK_CHUNKS
from tests.helpers import live_cpu_bytes, seeded

CHUNK = 32768
BLOCK = BLOCK_CHUNKS * CHUNK


def _model():
    # 256x600 (153,600 elements) is larger than a block (131,072): a block of its own; the rest share blocks
    return nn.Sequential(
        nn.Linear(256, 600), nn.Linear(600, 100), nn.LayerNorm(100), nn.Linear(100, 300), nn.Linear(300, 200)
    )


@pytest.fixture(autouse=True)
def _this_tests_objects_only():
    """Every object older than the test is frozen out of the garbage collector's view (``gc.freeze``): the counts
    below walk this test's objects only, not the whole session's (about a second per count late in a full run; the
    bounds are on what the test made, which stays in view)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _fp32_bytes(model) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def test_convert_splits_one_block_at_a_time_and_restore_gives_fp32_back_block_by_block(monkeypatch):
    with seeded():
        model = _model()
    reference = copy.deepcopy(model)
    fp32_model = _fp32_bytes(model)
    largest_block = 4 * max(BLOCK, max(p.numel() for p in model.parameters()))
    others = live_cpu_bytes() - fp32_model  # the reference model and whatever else this process holds
    seen = []
    split = blocks.split_by_chunks

    def measured_split(*args, **kwargs):
        seen.append(live_cpu_bytes() - others)
        return split(*args, **kwargs)

    monkeypatch.setattr(blocks, "split_by_chunks", measured_split)
    store = RemainderMasters(chunk_size=CHUNK)
    store.convert(model)
    # at every split: the fp32 parameters not yet split + the blocks made so far, never a second model
    assert len(seen) == 8 and max(seen) <= fp32_model + largest_block
    assert len(store.flat_buffers) >= 3  # the 256x600 weight alone, the others packed up to a block
    assert all(high.numel() <= BLOCK or high.numel() == 256 * 600 for high, _ in store.flat_buffers)
    for param, ref in zip(model.parameters(), reference.parameters()):
        exact = store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()
        assert torch.equal(exact, ref)
    del exact
    # bf16 + int16 per element (LayerNorm fp32): the fp32 model's size (1 KiB for stray scalars)
    assert live_cpu_bytes() - others <= fp32_model + 1024

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store.attach([optimizer])
    at_rest = live_cpu_bytes() - others
    released = []
    release = blocks.Blocks.release

    def measured_release(self, index):
        released.append(live_cpu_bytes() - others)
        return release(self, index)

    monkeypatch.setattr(blocks.Blocks, "release", measured_release)
    store.restore()
    assert len(released) >= 3 and max(released) <= at_rest + largest_block
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert param.dtype == torch.float32 and torch.equal(param, ref)
    assert live_cpu_bytes() - others <= at_rest + 1024  # the blocks are gone, the fp32 values took their place


def test_loading_a_state_dict_splits_the_values_without_copying_the_model(monkeypatch):
    with seeded():
        model = _model()
        source = _model()  # other values: the load must change every weight
    store = RemainderMasters(chunk_size=CHUNK)
    store.convert(model)
    store.attach([torch.optim.AdamW(model.parameters(), lr=1e-2)])
    state = source.state_dict()
    before = live_cpu_bytes()  # the converted model + the state dict to load
    seen = []
    split = blocks.split_by_chunks

    def measured_split(*args, **kwargs):
        seen.append(live_cpu_bytes() - before)
        return split(*args, **kwargs)

    monkeypatch.setattr(remainder, "split_by_chunks", measured_split)
    model.load_state_dict(state)
    assert len(seen) == 8 and max(seen) <= 1024  # no fp32 copy of the loaded values (only the split's temporaries)
    for param, ref in zip(model.parameters(), source.parameters()):
        exact = store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()
        assert torch.equal(exact, ref)


def _check_moved_then_attached(model, reference, move):
    store = RemainderMasters(chunk_size=CHUNK)
    store.convert(model)
    model._apply(move)  # what Lightning's model_to_device does after convert_module: the bf16 halves move
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store.attach([optimizer])
    flats = store.flat_buffers
    lean = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert sum(high.numel() for high, _ in flats) == sum(p.numel() for p in lean)  # the old blocks are released
    for param, ref in zip(model.parameters(), reference.parameters()):
        if param.dtype != torch.bfloat16:
            continue
        assert torch.equal(store.fp32_value(param), move(ref))  # the remainders followed the halves
        assert any(
            high.device == param.device and 0 <= param.data_ptr() - high.data_ptr() < high.numel() * 2
            for high, _ in flats
        )  # a view of a block again, on the parameter's device
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    store.fused_step(optimizer, None)
    store.restore()
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_parameters_moved_between_convert_and_attach_keep_their_exact_values():
    with seeded():
        model = _model()
    reference = copy.deepcopy(model)
    _check_moved_then_attached(model, reference, lambda t: t.clone())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blocks_follow_the_model_to_cuda_with_exact_values():
    with seeded():
        model = _model()
    reference = copy.deepcopy(model)
    _check_moved_then_attached(model, reference, lambda t: t.cuda())


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_released_block_is_freed_though_step_plans_gave_its_addresses_to_the_kernel(in_backward, monkeypatch):
    # the step plans (master/lean/plan.py) hold views of the blocks they read; a release must drop them, or restore keeps
    # every block alive until the end (4 bytes per parameter more than the fp32 model at teardown)
    import weakref

    from lightning_mp.kernels import native
    from lightning_mp.master import following
    from lightning_mp.master.lean import plan
    from lightning_mp.master.lean.optimizers import entry_for

    if native.cpu_kernel() is None:
        pytest.skip("the step plans need the compiled CPU kernel (no C compiler here)")
    with seeded():
        model = _model()
    store = RemainderMasters(chunk_size=CHUNK)
    store.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store.attach([optimizer])
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    if in_backward:  # what the step inside backward does: one plan per parameter
        group = optimizer.param_groups[0]
        now = following.seen(optimizer, state=True).state
        for param in model.parameters():
            one = {**group, "params": [param]}
            assert plan.run(optimizer, entry_for(optimizer), one, store.step_plans, store, [], None, now, param)
    else:
        store.fused_step(optimizer, None)
    assert len(store.step_plans) == (len(list(model.parameters())) if in_backward else 1)
    storages = [weakref.ref(t.untyped_storage()) for block in store.flat_buffers for t in block]
    alive_after_release = []
    release = blocks.Blocks.release

    def measured_release(self, index):
        release(self, index)
        gc.collect()
        alive_after_release.append(sum(ref() is not None for ref in storages))

    monkeypatch.setattr(blocks.Blocks, "release", measured_release)
    store.restore()
    count = len(storages) // 2
    assert count >= 3
    assert alive_after_release == [2 * (count - k - 1) for k in range(count)]  # each block gone at its release
