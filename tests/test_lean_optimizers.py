"""The table of optimizers the lean fast paths know (``master/lean/optimizers.py``) and the dispatch that reads it
(``master/lean/update.py``): an exact-type lookup, an entry that carries everything, one update object per optimizer
shared by the normal step and the step inside backward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from lightning_mp.master import RemainderMasters
from lightning_mp.master.in_backward.hooks import StepInBackward
from lightning_mp.master.lean.optimizers import TABLE, Entry, entry_for


def _store(optimizer_cls, **kwargs):
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    store = RemainderMasters()
    store.convert(model)
    optimizer = optimizer_cls(model.parameters(), lr=1e-2, **kwargs)
    store.attach([optimizer])
    return store, optimizer


def test_an_entry_cannot_be_made_without_every_field():
    """A class added with half an entry (today's KeyError 'dampening' deep inside the update) cannot be written:
    every field is required."""
    assert all(isinstance(entry, Entry) for entry in TABLE.values())
    assert all(field.default is dataclasses.MISSING for field in dataclasses.fields(Entry))
    with pytest.raises(TypeError, match="missing"):
        Entry(keys=lambda group: ())  # type: ignore[call-arg]


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs", "generic"),
    [
        (torch.optim.AdamW, {}, False),
        (torch.optim.SGD, {"momentum": 0.9}, False),
        (_MyAdamW, {}, True),  # a subclass: exact-type lookup, the generic path on purpose
        (torch.optim.AdamW, {"differentiable": True}, True),  # torch's fused kernel does not take it
        (torch.optim.RMSprop, {}, True),
    ],
)
def test_the_path_is_chosen_once_by_exact_type(optimizer_cls, kwargs, generic):
    store, optimizer = _store(optimizer_cls, **kwargs)
    update = store.updates.of(optimizer)
    assert (update.generic is not None) == generic
    assert (entry_for(optimizer) is None) == generic
    assert update.entry is (None if generic else TABLE[optimizer_cls])
    if not kwargs.get("differentiable"):  # torch's differentiable step is for autograd through it, not run here
        for param in optimizer.param_groups[0]["params"]:
            param.grad = torch.ones_like(param)
        store.fused_step(optimizer, None)
    assert store.updates.of(optimizer) is update  # chosen once, not per step


def test_the_step_inside_backward_calls_the_same_update_as_the_normal_step():
    store, optimizer = _store(torch.optim.AdamW)
    hooks = StepInBackward(store, optimizer)
    try:
        assert hooks.update is store.updates.of(optimizer)
    finally:
        hooks.remove()
