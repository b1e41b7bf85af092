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


def _store(blocks: int = 3) -> tuple[nn.Sequential, MasterWeights, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _model(blocks)
    store = MasterWeights(torch.bfloat16)
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


def test_gradients_move_as_per_parameter_copies_and_adds_in_fp32():
    model, store, _ = _store()
    first = _half_grads(model, seed=1, skip=2)  # one parameter without gradient: the general path
    store.grads_to_masters()
    second = _half_grads(model, seed=2)  # accumulation: masters with gradients get the new ones added
    store.grads_to_masters()
    for param, master in store.pairs():
        assert param.grad is None  # the half gradients are freed
        expected = None
        for grads in (first, second):
            if id(param) in grads:
                value = grads[id(param)].float()
                expected = value if expected is None else expected.add_(grads[id(param)])
        assert torch.equal(master.grad, expected)


def test_gradient_move_and_write_back_are_one_op_per_device_whatever_the_parameter_count():
    counts = []
    for blocks in (2, 20):
        model, store, optimizer = _store(blocks)
        _half_grads(model, seed=0)
        store.grads_to_masters()
        optimizer.step()
        store.masters_to_model(optimizer)  # the first write-back makes its lists; counted: the next step
        optimizer.zero_grad()
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
