"""torchao's ``AdamW8bit`` / ``Adam8bit`` on lean master weights in one pass (``master/lean/eightbit.py``).

The reference is torchao's own optimizer stepping fp32 copies of the model with the same gradients (its compiled
step, which the one-pass kernel equals bit for bit: tests/test_lean_adam8bit.py), or, where a test needs many steps or
options, that kernel's step of the joined fp32 values laid out by hand (cheap, and itself torchao's bits). The state
is torchao's: keyed by the model's parameters, 8-bit for tensors of 4096+ elements in whole blocks, fp32 otherwise, so
``state_dict`` goes both ways between the lean step and torchao's optimizer of an fp32 model.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_mp.kernels import adam8bit
from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean.eightbit import Adam8bitStep
from lightning_mp.master.lean.generic import leaves_of
from tests.helpers import saved_copy, seeded

torchao_optim = pytest.importorskip("torchao.optim")

KERNEL = pytest.mark.skipif(
    adam8bit.cpu_kernel() is None, reason="the 8-bit one-pass kernel is not built here (no C compiler)"
)


def _model() -> nn.Module:
    with seeded():  # a 128x64 weight (8-bit state), biases and a LayerNorm kept in fp32 (fp32 state)
        return nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 8))


def _lean(make, **kwargs):
    model = _model()
    store = RemainderMasters()
    store.convert(model)
    optimizer = make(model.parameters(), **kwargs)
    store.attach([optimizer])
    return store, model, optimizer


def _grads(params, generator, scale=1.0):
    grads = []
    for param in params:
        grad = (torch.randn(param.shape, generator=generator) * scale).to(param.dtype)
        param.grad = grad
        grads.append(grad)
    return grads


def _fp32(store, model):
    return [store.fp32_value(p) if p.dtype == torch.bfloat16 else p.detach().clone() for p in model.parameters()]


def _bits(tensor):
    return tensor.contiguous().view(torch.int32) if tensor.dtype == torch.float32 else tensor


def _same_state(ours, theirs) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            assert type(a[key]) is type(b[key]), key
            for x, y in zip(leaves_of(a[key]), leaves_of(b[key]), strict=True):
                assert torch.equal(_bits(x), _bits(y)), key


def _step_both(store, model, optimizer, reference, ref_optimizer, generator) -> None:
    """One step of the lean model and of torchao's optimizer on the fp32 ``reference``, the same gradients: the same
    weights after it, bit for bit."""
    for ref, grad in zip(reference, _grads(model.parameters(), generator)):
        ref.grad = grad.float()
    store.fused_step(optimizer, None)
    ref_optimizer.step()
    for ours, theirs in zip(_fp32(store, model), reference):
        assert torch.equal(_bits(ours), _bits(theirs.detach()))


@KERNEL
@pytest.mark.parametrize("name", ["AdamW8bit", "Adam8bit"])
def test_bitwise_torchaos_own_optimizer_on_fp32_and_its_state_both_ways(name):
    """Three steps of the lean step and of torchao's optimizer (compiled) on fp32 copies, same gradients: every
    weight, code, scale, fp32 moment and step count equal; then torchao's optimizer continues from the lean step's
    state_dict, and the lean step from torchao's, both bitwise."""
    make = getattr(torchao_optim, name)
    options = dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95))
    store, model, optimizer = _lean(make, **options)
    assert type(store.updates.of(optimizer).generic) is Adam8bitStep
    reference = [p.detach().clone().requires_grad_() for p in _fp32(store, model)]
    ref_optimizer = make(reference, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        _step_both(store, model, optimizer, reference, ref_optimizer, generator)
    states = [optimizer.state[p] for p in model.parameters()]  # keyed by the model's own parameters
    _same_state(states, [ref_optimizer.state[p] for p in reference])
    assert type(states[0]["exp_avg"]).__name__ == "OptimState8bit" and states[0]["exp_avg"].shape == (128, 64)
    assert all(type(s["exp_avg"]) is torch.Tensor and s["exp_avg"].dtype == torch.float32 for s in states[1:])

    # torchao's optimizer on an fp32 copy of the lean weights, from the lean step's state_dict, and back
    theirs = [p.detach().clone().requires_grad_() for p in _fp32(store, model)]
    their_optimizer = make(theirs, **options)
    their_optimizer.load_state_dict(saved_copy(optimizer.state_dict()))
    _step_both(store, model, optimizer, theirs, their_optimizer, generator)
    _same_state([optimizer.state[p] for p in model.parameters()], [their_optimizer.state[p] for p in theirs])
    optimizer.load_state_dict(saved_copy(their_optimizer.state_dict()))  # fp32 moments stay fp32 (not bf16)
    assert all(optimizer.state[p]["exp_avg"].dtype == torch.float32 for p in model.parameters())
    _step_both(store, model, optimizer, theirs, their_optimizer, generator)


def _swap_storage(tensor):
    """``tensor.data = a copy``: the same tensor object over new memory (the old freed once nothing holds it)."""
    tensor.data = tensor.detach().clone()


def _kernel_reference(values, states, grads, *, factor=None, **options):
    """The 8-bit kernel's step of fp32 ``values`` with ``states`` (torchao's bits), for many-step checks."""
    for value, state, grad in zip(values, states, grads):
        adam8bit.adam8bit_step(
            value, None, grad.float().contiguous(), state["exp_avg"], state["exp_avg_sq"], state["step"],
            grad_mul=factor, **options,
        )  # fmt: skip


@KERNEL
def test_a_found_inf_changes_nothing_and_the_next_step_is_the_same_as_without_it():
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
    generator = torch.Generator().manual_seed(2)
    _grads(model.parameters(), generator)
    store.fused_step(optimizer, None)
    before = _fp32(store, model)
    state = saved_copy([optimizer.state[p] for p in model.parameters()])
    _grads(model.parameters(), generator)
    store.fused_step(optimizer, torch.ones(()))
    for ours, was in zip(_fp32(store, model), before):
        assert torch.equal(_bits(ours), _bits(was))
    _same_state([optimizer.state[p] for p in model.parameters()], state)
    assert float(optimizer.state[next(model.parameters())]["step"]) == 1.0


@KERNEL
def test_replayed_layouts_follow_every_edit_of_the_state_and_the_groups():
    """The layout a step replays is made again whenever the optimizer's state or groups changed (state cleared, a
    moment replaced, a parameter's gradient gone): each step equals the kernel's step of what the optimizer holds."""
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2, weight_decay=0.05)
    params = list(model.parameters())
    step = store.updates.of(optimizer).generic
    generator = torch.Generator().manual_seed(3)
    edits = [
        lambda: None,
        lambda: None,
        lambda: optimizer.state[params[0]].clear(),  # made again, fresh
        lambda: optimizer.state[params[2]].__setitem__("exp_avg", torch.ones(128)),  # a new moment tensor
        lambda: optimizer.param_groups[0]["lr"].fill_(3e-3),  # a scheduler's way
        lambda: None,
        lambda: _swap_storage(optimizer.state[params[0]]["exp_avg"].codes),  # an inner tensor's storage swapped
        lambda: optimizer.state.__setitem__(params[1], saved_copy(dict(optimizer.state[params[1]]))),  # restored copy
        lambda: optimizer.load_state_dict(saved_copy(optimizer.state_dict())),
        lambda: optimizer.param_groups[0]["params"].reverse(),  # the group's parameters permuted in place
    ]
    layouts = []
    for edit in edits:
        edit()
        values = _fp32(store, model)
        states = saved_copy([optimizer.state[p] for p in params])
        grads = _grads(params, generator)
        for p, s in zip(params, states):
            if not s:
                s.update(step=torch.tensor(0.0))
                like = torch.zeros(p.shape)
                s["exp_avg"], s["exp_avg_sq"] = optimizer._new_buffer(like, True), optimizer._new_buffer(like, False)
        store.fused_step(optimizer, None)
        group = optimizer.param_groups[0]
        _kernel_reference(values, states, grads, lr=group["lr"], weight_decay=0.05)
        for ours, value in zip(_fp32(store, model), values):
            assert torch.equal(_bits(ours), _bits(value))
        _same_state([optimizer.state[p] for p in params], states)
        layouts.append(step.layouts.get(0))
    assert layouts[1] is layouts[0]  # replayed: the state the first step made is the step's own
    assert layouts[2] is not layouts[1] and layouts[3] is not layouts[2]  # made again after each edit of the state
    assert layouts[5] is layouts[4] is layouts[3]  # the lr is read at each step, not laid out
    assert all(layouts[k] is not layouts[k - 1] for k in range(6, 10))  # each edit after it: made again


@KERNEL
@pytest.mark.parametrize("clip", ["norm", "value", "norm+value"])
def test_clipping_through_the_kernel_equals_torchaos_own_step_on_the_joined_values(monkeypatch, clip):
    """The kernel's clipping (the store's deferred clip_grad_norm_ factor, clip_grad_value_ bound, or both) against
    the other path (torchao's own compiled step per parameter, as on a GPU or without a compiler), bitwise."""
    from lightning_mp.master.lean import eightbit

    results = []
    for native in ("1", "0"):
        store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
        if native == "0":  # the path chosen, the kernel then unavailable to its layouts: torchao's own step
            monkeypatch.setattr(eightbit.adam8bit, "cpu_kernel", lambda: None)
        generator = torch.Generator().manual_seed(4)
        for _ in range(2):
            _grads(model.parameters(), generator, scale=10.0)
            if "norm" in clip:
                store.clip_grad_norm_(optimizer, 1.0, 2.0)
            if "value" in clip:
                store.clip_grad_value_(optimizer, 0.05)
            store.fused_step(optimizer, None)
        layout = store.updates.of(optimizer).generic.layouts[0]
        assert (layout.rows is not None) == (native == "1")
        results.append((_fp32(store, model), [optimizer.state[p] for p in model.parameters()]))
    for ours, theirs in zip(results[0][0], results[1][0]):
        assert torch.equal(_bits(ours), _bits(theirs))
    _same_state(results[0][1], results[1][1])


def test_the_one_pass_path_is_taken_where_its_kernel_runs_else_the_generic_path(monkeypatch):
    """Without the kernel (LIGHTNING_MP_NATIVE=0, no compiler, or a GPU: no Triton 8-bit kernel yet) torchao's 8-bit
    optimizers keep the generic path, chunked, skipping on the device."""
    from lightning_mp.master.lean.generic import GenericChunkedStep

    store, _, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
    assert type(store.updates.of(optimizer).generic) is (Adam8bitStep if adam8bit.cpu_kernel() else GenericChunkedStep)
    monkeypatch.setenv("LIGHTNING_MP_NATIVE", "0")
    store, _, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
    assert type(store.updates.of(optimizer).generic) is GenericChunkedStep


@KERNEL
def test_amsgrad_and_a_float_lr_are_refused_before_any_update():
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2, amsgrad=True)
    _grads(model.parameters(), torch.Generator().manual_seed(5))
    before = _fp32(store, model)
    with pytest.raises(NotImplementedError, match=r"amsgrad=True.*param_groups\[0\].*Nothing was updated"):
        store.fused_step(optimizer, None)
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
    optimizer.param_groups[0]["lr"] = 1e-3
    _grads(model.parameters(), torch.Generator().manual_seed(5))
    before = _fp32(store, model)
    with pytest.raises(RuntimeError, match=r"\['lr'\] is 0.001.*fill_"):
        store.fused_step(optimizer, None)
    assert all(torch.equal(a, b) for a, b in zip(_fp32(store, model), before)) and not optimizer.state


@KERNEL
def test_state_the_kernel_cannot_read_is_refused_by_name_before_any_update():
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
    params = list(model.parameters())
    _grads(params, torch.Generator().manual_seed(6))
    store.fused_step(optimizer, None)
    optimizer.state[params[3]]["exp_avg"] = torch.zeros(128, dtype=torch.bfloat16)
    _grads(params, torch.Generator().manual_seed(7))
    before = _fp32(store, model)
    with pytest.raises(ValueError, match=r"shape \(128,\) in param_groups\[0\].*Nothing was updated"):
        store.fused_step(optimizer, None)
    assert all(torch.equal(a, b) for a, b in zip(_fp32(store, model), before))


@KERNEL
@pytest.mark.parametrize("in_backward", [False, True])
def test_a_resumed_fit_continues_bitwise_as_the_uninterrupted_one(tmp_path, in_backward):
    """Lightning's Trainer, AdamW8bit on lean masters (normal step, or inside backward): 8 steps in one go, and one
    epoch (6 steps: Lightning resumes an epoch from its start) then a resume from its checkpoint for 2 more, end with
    the same fp32 weights and 8-bit state, bit for bit."""
    from tests.test_in_backward_generic import _assert_same_bits, _fit

    _, whole = _fit(in_backward, tmp_path, "whole", "torchao-adamw8bit", max_steps=8)
    _fit(in_backward, tmp_path, "half", "torchao-adamw8bit", max_steps=6)
    _, resumed = _fit(in_backward, tmp_path, "resumed", "torchao-adamw8bit", resume=tmp_path / "half.ckpt", max_steps=8)
    _assert_same_bits(resumed, whole)
    kinds = [type(s["exp_avg"]).__name__ for s in whole["optimizer_states"][0]["state"].values()]
    assert kinds.count("OptimState8bit") == 1  # the 256x16 weight; the rest fp32


def test_inside_backward_the_8bit_kernel_takes_torchs_threads_on_torchs_pool():
    """The 8-bit kernel's threads inside backward follow its own build (torch's OpenMP pool: torch's count), not the
    AdamW kernel's, which a run with only torchao's optimizer may never build (one thread, measured 1.3x slower on the
    1.57B Llama's step inside backward)."""
    from lightning_mp.kernels import native

    with native.inside_backward():
        assert native.threads_for("openmp") == torch.get_num_threads()
        assert native.threads_for("pthreads") == 1
    assert native.threads_for("pthreads") == torch.get_num_threads()  # outside backward: torch's


@KERNEL
def test_a_parameter_without_a_gradient_is_left_alone_and_the_others_step_as_torchaos():
    """A parameter frozen for a step (its gradient None, as torchao's own step skips it), then trained again: each step
    equals torchao's optimizer on fp32 copies with the same gradients, the layout made again each time."""
    options = dict(lr=1e-2, weight_decay=0.1)
    store, model, optimizer = _lean(torchao_optim.AdamW8bit, **options)
    reference = [p.detach().clone().requires_grad_() for p in _fp32(store, model)]
    ref_optimizer = torchao_optim.AdamW8bit(reference, **options)
    generator = torch.Generator().manual_seed(8)
    params = list(model.parameters())
    for frozen in (None, 0, None, 3):
        for index, (ref, grad) in enumerate(zip(reference, _grads(params, generator))):
            ref.grad = None if index == frozen else grad.float()
            if index == frozen:
                params[index].grad = None
        store.fused_step(optimizer, None)
        ref_optimizer.step()
        for ours, theirs in zip(_fp32(store, model), reference):
            assert torch.equal(_bits(ours), _bits(theirs.detach()))
    _same_state([optimizer.state[p] for p in params], [ref_optimizer.state[p] for p in reference])


@KERNEL
def test_inside_backward_amsgrad_in_a_later_group_is_refused_before_any_parameter_is_updated():
    """Inside backward the hooks update parameter by parameter: the group options are checked before backward, so a
    group torchao cannot step (amsgrad) stops the step before any parameter of an earlier group moved."""
    from lightning_mp.master.in_backward import StepInBackward

    model = _model()
    store = RemainderMasters()
    store.convert(model)
    groups = [{"params": list(model[0].parameters())}, {"params": list(model[1:].parameters()), "amsgrad": True}]
    optimizer = torchao_optim.AdamW8bit(groups, lr=1e-2)
    store.attach([optimizer])
    stepper = StepInBackward(store, optimizer)
    try:
        before = _fp32(store, model)
        loss = model(torch.randn(4, 64).to(torch.bfloat16)).float().pow(2).mean()
        with pytest.raises(NotImplementedError, match=r"amsgrad=True.*param_groups\[1\]"):
            stepper.begin(loss)
            loss.backward()
        assert all(torch.equal(a, b) for a, b in zip(_fp32(store, model), before))
    finally:
        stepper.remove()


@KERNEL
@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda state: state.pop("exp_avg"), r"KeyError.*holds \['exp_avg_sq', 'step'\] but not 'exp_avg'"),
        (lambda state: state.__setitem__("exp_avg", torch.zeros(3)), r"ValueError.*cannot be read as torchao's"),
    ],
    ids=["a moment popped", "a moment of the wrong size"],
)
def test_inside_backward_a_state_edited_in_the_group_updated_last_is_refused_before_any_parameter_is_updated(
    edit, error
):
    """Inside backward the last layer's parameters are updated first. A state torchao's step cannot read, edited
    between two backwards in the first layer (updated last), is refused when that backward begins (every state is
    checked where the state changed since the last layout), before any parameter moved: the weights and every state
    are as they were. (Before the check, the layer's hook raised after the later layers had been updated.)"""
    from lightning_mp.master.in_backward import StepInBackward

    store, model, optimizer = _lean(torchao_optim.AdamW8bit, lr=1e-2)
    stepper = StepInBackward(store, optimizer)
    try:
        for _ in range(2):  # the state made and laid out
            stepper.begin(loss := model(torch.randn(4, 64).to(torch.bfloat16)).float().pow(2).mean())
            loss.backward()
            stepper.finish()
        edit(optimizer.state[model[0].weight])
        before, states = _fp32(store, model), saved_copy([optimizer.state[p] for p in model.parameters()])
        loss = model(torch.randn(4, 64).to(torch.bfloat16)).float().pow(2).mean()
        with pytest.raises((KeyError, ValueError)) as raised:
            stepper.begin(loss)
            loss.backward()
        assert re.search(error, f"{raised.type.__name__}: {raised.value}"), raised.value
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(_fp32(store, model), before))
        _same_state([optimizer.state[p] for p in model.parameters()], states)
    finally:
        stepper.remove()
