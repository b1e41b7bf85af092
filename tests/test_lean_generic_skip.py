"""The generic lean-masters path (any optimizer, :mod:`lightning_mp.master.lean.generic`) skips a non-finite step on the
device by a masked write-back: no host synchronisation, and every bit (weights, remainders, fp32 parameters,
optimizer state, group counters) as a skip decided on the host leaves it; finite steps bitwise the optimizer's own.

Reference: the same store and model driven with the decision taken on the host (a skipped step not run at all, a
finite one run without a flag), as the generic path did before. Syncs are counted by ``HostSyncCounter`` (tests/
helpers.py), which counts what would be a synchronisation on an accelerator.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.overrides import _pop_mode_temporarily

from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean.generic import leaves_of as _leaves
from tests.helpers import HostSyncCounter, generic_adamw8bit, seeded

FLAGS = [1, 0, 0, 1, 0, 0, 1, 0]  # a skip before any state exists, then finite and skipped steps
#: the first step reads the flag (it skips: no state to mask yet), the second reads it (it makes the state), the
#: third reads it and learns that the optimizer's state can be masked; every later step decides on the device
DEVICE_SYNCS = [1, 1, 1, 0, 0, 0, 0, 0]


class SubclassedSGD(torch.optim.SGD):
    """Not exactly torch.optim.SGD, so it takes the generic path (its momentum buffer is made on the first step)."""


class PythonCounterSGD(torch.optim.Optimizer):
    """Plain SGD that counts its steps as a Python int in the per-parameter state: not maskable on the device."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    state = self.state[param]
                    state["n"] = state.get("n", 0) + 1
                    param.add_(param.grad, alpha=-group["lr"] / state["n"])


class GroupCounterSGD(torch.optim.Optimizer):
    """Plain SGD that counts its steps as a Python int in its param group: not maskable on the device."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr, n=0))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["n"] += 1
            for param in group["params"]:
                if param.grad is not None:
                    self.state[param]["momentum"] = torch.zeros_like(param)
                    param.add_(param.grad, alpha=-group["lr"] / group["n"])


def _torchao_8bit(params: Any) -> torch.optim.Optimizer:
    pytest.importorskip("torchao.optim")
    return generic_adamw8bit(params, lr=1e-2)  # the generic path (AdamW8bit itself takes the one-pass 8-bit step)


def _optimi_adamw(params: Any) -> torch.optim.Optimizer:  # its step counter is a tensor in the param group
    return pytest.importorskip("optimi").AdamW(params, lr=1e-2, weight_decay=1e-2, kahan_sum=True)


# (make, the optimizer's own step reads tensors on the host (left out of the count), syncs per step)
CASES = {
    "rmsprop-centered-momentum": (
        lambda ps: torch.optim.RMSprop(ps, lr=1e-3, momentum=0.9, centered=True),
        False,
        DEVICE_SYNCS,
    ),
    "sgd-subclass-nesterov": (
        lambda ps: SubclassedSGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3),
        False,
        DEVICE_SYNCS,
    ),
    "torchao-adamw8bit": (_torchao_8bit, True, DEVICE_SYNCS),
    "optimi-adamw-kahan": (_optimi_adamw, True, DEVICE_SYNCS),
    "python-counter-in-state": (lambda ps: PythonCounterSGD(ps, lr=1e-2), False, [1] * len(FLAGS)),
    "python-counter-in-group": (lambda ps: GroupCounterSGD(ps, lr=1e-2), False, [1] * len(FLAGS)),
}


def _model() -> nn.Module:
    # a 300x333 weight cut into four row blocks at chunk_size=32768, a LayerNorm kept fp32 (masked in place)
    return nn.Sequential(nn.Linear(300, 333), nn.LayerNorm(333), nn.Linear(333, 7))


def _store(make: Callable[..., torch.optim.Optimizer], model: nn.Module) -> tuple[RemainderMasters, Any]:
    store = RemainderMasters(chunk_size=32768)
    store.convert(model)
    optimizer = make(model.parameters())
    store.attach([optimizer])
    return store, optimizer


def _uncounted(method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _pop_mode_temporarily():
            return method(*args, **kwargs)

    return run


def _state_leaves(optimizer: torch.optim.Optimizer) -> list[Any]:
    leaves: list[Any] = []
    for state in optimizer.state_dict()["state"].values():
        for key in sorted(state):
            value = state[key]
            leaves += [(key, t) for t in _leaves(value)] if isinstance(value, torch.Tensor) else [(key, value)]
    for group in optimizer.param_groups:
        leaves += [(key, value) for key, value in sorted(group.items()) if key != "params"]
    return leaves


def _assert_same(store, model, ref_store, reference, optimizer, ref_optimizer, step) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        value = store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()
        ref_value = ref_store.fp32_value(ref) if ref.dtype == torch.bfloat16 else ref.detach()
        assert torch.equal(value.view(torch.int32), ref_value.view(torch.int32)), (step, name)
    for (key, value), (ref_key, ref_value) in zip(_state_leaves(optimizer), _state_leaves(ref_optimizer), strict=True):
        assert key == ref_key
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, ref_value), (step, key)
        else:
            assert value == ref_value, (step, key)


@pytest.mark.parametrize("case", sorted(CASES))
def test_generic_path_skips_on_the_device_bitwise_as_the_host_skip(case, monkeypatch):
    make, syncs_itself, expected_syncs = CASES[case]
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)  # torchao compiles its step: eager, both sides
    with seeded():
        model = _model()
    reference = copy.deepcopy(model)
    store, optimizer = _store(make, model)
    ref_store, ref_optimizer = _store(make, reference)
    if syncs_itself:  # count the syncs of our path, not those inside the optimizer's own step
        optimizer.step = _uncounted(optimizer.step)
    generator = torch.Generator().manual_seed(4)
    syncs = []
    for step, flag in enumerate(FLAGS):
        for param, ref in zip(model.parameters(), reference.parameters()):
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            param.grad, ref.grad = grad, grad.clone()
        if flag:  # what a flagged step holds: non-finite gradients (the optimizer runs on them, then is masked)
            weight, *_, bias = model.parameters()
            weight.grad.view(-1)[7] = float("inf")
            bias.grad.view(-1)[0] = float("nan")
        counter = HostSyncCounter()
        with counter:
            store.fused_step(optimizer, torch.tensor(float(flag)))
        syncs.append(len(counter.calls))
        if not flag:  # the host decision: a skipped step does not run at all
            ref_store.fused_step(ref_optimizer, None)
        _assert_same(store, model, ref_store, reference, optimizer, ref_optimizer, step)
    assert syncs == expected_syncs
    assert store.updates.of(optimizer).generic.masks_on_device == (expected_syncs == DEVICE_SYNCS)
    assert any(FLAGS[step] for step, count in enumerate(syncs) if count == 0) == (expected_syncs == DEVICE_SYNCS)


class LateStateSGD(torch.optim.Optimizer):
    """Plain SGD that adds a state tensor on its fourth step: masking cannot restore what did not exist."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    state = self.state[param]
                    state["calls"] = state.get("calls", torch.zeros(())) + 1
                    if state["calls"] >= 4:
                        state["late"] = torch.zeros_like(param)
                    param.add_(param.grad, alpha=-group["lr"])


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_state_added_after_the_first_steps_is_undone_on_a_skip_and_the_host_decides_from_then_on(flag):
    with seeded():
        model = _model()
    reference = copy.deepcopy(model)
    store, optimizer = _store(lambda ps: LateStateSGD(ps, lr=1e-2), model)
    ref_store, ref_optimizer = _store(lambda ps: LateStateSGD(ps, lr=1e-2), reference)
    optimizer.step = _uncounted(optimizer.step)  # its own `if calls >= 4` reads a tensor
    for step in range(5):
        for param, ref in zip(model.parameters(), reference.parameters()):
            param.grad = torch.full_like(param, 0.5 + step)
            ref.grad = param.grad.clone()
        now = flag if step == 3 else 0.0  # step 3 adds the late state
        counter = HostSyncCounter()
        with counter:
            store.fused_step(optimizer, torch.tensor(now))
        if step == 3:
            assert len(counter.calls) == 1  # the flag read once, when the new state showed up
        if not now:
            ref_store.fused_step(ref_optimizer, None)
        _assert_same(store, model, ref_store, reference, optimizer, ref_optimizer, step)
    assert store.updates.of(optimizer).generic.masks_on_device is False
