"""Flat fp32 masters' per-step moves (``lightning_mp.master.flat_moves``): the gradients into the masters and the
masters back into the model are one foreach op per device whatever the number of parameters, equal bit for bit to
the per-parameter moves, bump no version counter of the model, and still reach the model after a write gave a
parameter new storage (the write-back's aliases are made again)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from lightning_mp.master import MasterWeights
from tests.helpers import AtenOps


def _model(blocks: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8)]  # LayerNorm stays fp32: no master
    return nn.Sequential(*layers)


def _store(blocks: int = 3, show: bool = False) -> tuple[nn.Sequential, MasterWeights, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _model(blocks)
    store = MasterWeights(torch.bfloat16, show_grads=show)
    store.convert(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    store.attach([optimizer])
    return model, store, optimizer


def _half_grads(model: nn.Module, seed: int, skip: int = -1) -> dict[int, torch.Tensor]:
    """Random gradients on the bf16 parameters (none on the ``skip``-th); their values, by id of the parameter."""
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for index, param in enumerate(p for p in model.parameters() if p.dtype == torch.bfloat16):
        if index != skip:
            param.grad = torch.randn(param.shape, generator=generator).to(torch.bfloat16)
            grads[id(param)] = param.grad.clone()
    return grads


@pytest.mark.parametrize("show", [False, True], ids=["freed", "shown"])
def test_gradients_move_as_per_parameter_copies_and_adds_in_fp32(show):
    model, store, _ = _store(show=show)
    first = _half_grads(model, seed=1, skip=2)  # one parameter without gradient: the general path
    store.grads_to_masters()
    if show:
        store.hide_grads()  # as DDP before each backward: the new half gradients add to the masters'
    second = _half_grads(model, seed=2)  # accumulation: masters with gradients get the new ones added
    store.grads_to_masters()
    for param, master in store.pairs():
        if show:  # the master's gradient shown, in the same memory: no copy
            assert param.grad.dtype == torch.float32 and param.grad.data_ptr() == master.grad.data_ptr()
        else:
            assert param.grad is None  # the half gradients are freed
        expected = None
        for grads in (first, second):
            if id(param) in grads:
                value = grads[id(param)].float()
                expected = value if expected is None else expected.add_(grads[id(param)])
        assert torch.equal(master.grad, expected)


def test_a_backward_adds_into_the_shown_gradients_in_fp32_and_a_gradient_put_there_after_it_replaces():
    model, store, _ = _store(show=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    model(x).float().square().sum().backward()
    halves = {id(p): p.grad.clone() for p in model.parameters() if p.dtype == torch.bfloat16}
    store.grads_to_masters()
    shown = {id(p): p.grad for p, _ in store.pairs()}
    store.before_backward()  # nothing changed: the model still shows the masters' gradients
    model(x).float().square().sum().backward()  # autograd adds into the shown fp32 gradients, in place
    store.grads_to_masters()  # nothing left to move
    for param, master in store.pairs():
        assert param.grad is shown[id(param)]
        assert torch.equal(master.grad, halves[id(param)].float() + halves[id(param)].float())
    replaced = next(p for p, _ in store.pairs())
    replaced.grad = torch.ones_like(replaced)  # put there after a backward (on_after_backward): it replaces
    store.grads_to_masters()
    assert torch.equal(store.master_of(replaced).grad, torch.ones(replaced.shape))
    assert replaced.grad.dtype == torch.float32


@pytest.mark.parametrize("show", [False, True], ids=["freed", "shown"])
def test_gradient_move_and_write_back_are_one_op_per_device_whatever_the_parameter_count(show):
    counts = []
    for blocks in (2, 20):
        model, store, optimizer = _store(blocks, show)
        _half_grads(model, seed=0)
        store.grads_to_masters()
        optimizer.step()
        store.masters_to_model(optimizer)  # the first write-back makes its lists; counted: the next step
        optimizer.zero_grad()
        with AtenOps() as followed:
            store.before_backward()  # the masters' gradients were freed: so are the ones the model shows
        assert followed.ops == [] and all(p.grad is None for p, _ in store.pairs())
        _half_grads(model, seed=1)
        with AtenOps() as moved:
            store.grads_to_masters()
        optimizer.step()
        versions = [p._version for p in model.parameters()]
        with AtenOps() as written:
            store.masters_to_model(optimizer)
        assert [p._version for p in model.parameters()] == versions  # not a write the model sync must follow
        for param, master in store.pairs():
            assert torch.equal(param, master.detach().to(torch.bfloat16))
        counts.append((dict(Counter(moved.ops)), dict(Counter(written.ops))))
    assert counts[0] == counts[1] == ({"aten._foreach_copy_.default": 1}, {"aten._foreach_copy_.default": 1})


@pytest.mark.parametrize("started", [True, False], ids=["followed", "store-alone"])
def test_write_back_reaches_a_parameter_given_new_storage(started):
    model, store, optimizer = _store()
    store.masters_to_model(optimizer)  # the write-back's aliases are made
    if started:
        store.model_sync.start()
    param = model[0].weight
    with torch.no_grad():
        param.data = torch.full_like(param, 0.25)  # new storage
    if started:
        store.model_sync.follow()  # the masters take the written value (and the model gets a copy: new storage)
        assert torch.equal(store.master_of(param), torch.full(param.shape, 0.25))
    _half_grads(model, seed=3)
    store.grads_to_masters()
    optimizer.step()
    store.masters_to_model(optimizer)
    for half, master in store.pairs():
        assert torch.equal(half, master.detach().to(torch.bfloat16))
    assert not torch.equal(param, torch.full_like(param, 0.25))  # the step reached the new storage


def test_gradients_kept_from_before_zero_grad_keep_their_values_and_the_buffer_is_reused_otherwise():
    """As with the built-in's freed gradients: a tensor code kept from before ``optimizer.zero_grad()`` (SAM keeps the
    first backward's) is not overwritten by the next backward's gradients; the masters' views move to a new buffer
    then, and only then."""
    model, store, optimizer = _store(show=True)
    _half_grads(model, seed=1)
    store.grads_to_masters()
    (_, flat_grad), *_ = store.flat_buffers
    optimizer.zero_grad()
    store.before_backward()  # the masters' gradients are freed: so are the model's
    assert all(param.grad is None for param, _ in store.pairs())
    _half_grads(model, seed=2)
    store.grads_to_masters()
    assert store.flat_buffers[0][1].data_ptr() == flat_grad.data_ptr()  # nothing held the old ones: reused

    kept = {id(param): param.grad for param, _ in store.pairs()}  # no copy: the shown tensors themselves
    values = {key: grad.clone() for key, grad in kept.items()}
    optimizer.zero_grad()
    store.before_backward()
    third = _half_grads(model, seed=3)
    with AtenOps() as moved:
        store.grads_to_masters()
    assert store.flat_buffers[0][1].data_ptr() != flat_grad.data_ptr()  # a new buffer for the masters
    for param, master in store.pairs():
        assert torch.equal(kept[id(param)], values[id(param)])  # what was kept is what it was
        assert torch.equal(master.grad, third[id(param)].float()) and param.grad.data_ptr() == master.grad.data_ptr()
    assert Counter(moved.ops)["aten._foreach_copy_.default"] == 1
