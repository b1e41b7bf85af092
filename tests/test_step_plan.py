"""The step plan of the one-pass lean update (lightning_mp.master.lean.plan): made once, replayed each step with nothing
but the gradients' addresses, rebuilt when what it recorded changes, and bitwise torch's fused optimizer throughout.

Reference: torch's own ``fused=True`` optimizer on fp32 parameters holding the exact values, given the same
gradients, through every change the plan must follow (a gradient that appears, gradients of both dtypes, a
non-contiguous one, a resume, a param group added, a skipped step)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_mp.kernels import native
from lightning_mp.master import RemainderMasters, following
from lightning_mp.master.lean import plan
from lightning_mp.master.lean.optimizers import entry_for
from tests.helpers import AtenOps, seeded


@pytest.fixture(autouse=True)
def kernel():
    if native.cpu_kernel() is None:
        pytest.skip("no C compiler here: the chunked path has no plan")


def _model() -> nn.Module:
    with seeded():  # Linear weights and biases go lean; the LayerNorm stays fp32 (no remainder)
        return nn.Sequential(nn.Linear(16, 33), nn.LayerNorm(33), nn.Linear(33, 1003), nn.Linear(1003, 5))


def _setup(optimizer_cls, kwargs, params=lambda model: model.parameters()):
    model = _model()
    reference = copy.deepcopy(model)
    store = RemainderMasters()
    store.convert(model)
    optimizer = optimizer_cls(params(model), **kwargs)
    store.attach([optimizer])
    ref_optimizer = optimizer_cls(params(reference), **kwargs, fused=True)
    return model, reference, store, optimizer, ref_optimizer


def _exact(store, param):
    return store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()


def _grads(model, reference, generator, skip=(), fp32=(), transposed=()):
    for index, (param, ref) in enumerate(zip(model.parameters(), reference.parameters())):
        if index in skip:
            param.grad = ref.grad = None
            continue
        if index in transposed:  # a non-contiguous gradient: read through a contiguous copy
            grad = torch.randn(tuple(reversed(param.shape)), generator=generator).to(param.dtype).t()
        else:
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        param.grad, ref.grad = grad, grad.float().contiguous()
        if index in fp32:  # accumulated in fp32 (as the store widens it): one group, gradients of both dtypes
            RemainderMasters._widen_grad(param.grad)


def _step(store, optimizer, ref_optimizer, found=None):
    store.fused_step(optimizer, found)
    if found is not None:  # torch.amp's protocol: a fused optimizer skips where found_inf is 1
        ref_optimizer.grad_scale, ref_optimizer.found_inf = None, found
    ref_optimizer.step()
    ref_optimizer.__dict__.pop("found_inf", None)
    ref_optimizer.__dict__.pop("grad_scale", None)


def _assert_same(model, reference, store, optimizer, ref_optimizer):
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param).view(torch.int32), ref.detach().view(torch.int32))
    state, ref_state = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for index in ref_state:
        for key, value in ref_state[index].items():
            assert torch.equal(state[index][key], value), (index, key)


CASES = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, maximize=True)),
    (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),
    (torch.optim.SGD, dict(lr=1e-2)),
]


@pytest.mark.parametrize(("optimizer_cls", "kwargs"), CASES)
def test_the_plan_follows_every_change_and_stays_bitwise_torchs_fused_optimizer(optimizer_cls, kwargs):
    # the last Linear joins the optimizer later, as add_param_group does during fit
    model, reference, store, optimizer, ref_optimizer = _setup(
        optimizer_cls, kwargs, params=lambda m: [p for layer in list(m)[:3] for p in layer.parameters()]
    )
    generator = torch.Generator().manual_seed(0)

    def step(found=None, **changes):
        _grads(model, reference, generator, skip=changes.pop("skip", (6, 7)), **changes)
        _step(store, optimizer, ref_optimizer, found)
        _assert_same(model, reference, store, optimizer, ref_optimizer)
        return store.step_plans[id(optimizer.param_groups[0])]

    # the first Linear's weight has no gradient yet (torch's fused SGD cannot take a momentum buffer made later)
    late = not kwargs.get("momentum")
    first = step(skip=(0, 6, 7) if late else (6, 7))
    second = step()  # now it has: its state is made, the plan made again
    assert (second is not first) == late
    assert step() is second  # new gradient tensors, the same plan
    assert step(fp32=(4,), transposed=(0,)) is second  # both dtypes in one pass, a non-contiguous gradient
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.load_state_dict(saved)  # a resume: new state tensors, new group dicts
    ref_optimizer.load_state_dict(copy.deepcopy(ref_optimizer.state_dict()))
    assert step() is not second
    optimizer.add_param_group({"params": list(model[3].parameters())})
    ref_optimizer.add_param_group({"params": list(reference[3].parameters())})
    step(skip=())
    assert id(optimizer.param_groups[1]) in store.step_plans
    step(skip=(), found=torch.ones((), dtype=torch.float32))  # skipped: weights, state and step counts unchanged
    step(skip=(), found=torch.zeros((), dtype=torch.float32))


@pytest.mark.parametrize(("optimizer_cls", "kwargs"), CASES[:1] + CASES[2:3])
def test_a_replayed_step_issues_no_op(optimizer_cls, kwargs):
    """Lean parameters and fp32 ones (kept in fp32, updated in place): the C kernel alone, step counts advanced in
    it; per parameter (the step inside backward) the same."""
    model, reference, store, optimizer, ref_optimizer = _setup(optimizer_cls, kwargs)
    generator = torch.Generator().manual_seed(1)
    found = torch.zeros((), dtype=torch.float32)
    _grads(model, reference, generator)
    _step(store, optimizer, ref_optimizer, found)
    _grads(model, reference, generator)
    with AtenOps() as counted:
        store.fused_step(optimizer, found)
    assert counted.ops == []
    group = optimizer.param_groups[0]
    lean, fp32 = model[0].weight, model[1].weight
    for param in (lean, fp32):  # the step inside backward: one-parameter groups, a plan per parameter
        one = {**group, "params": [param]}
        now = following.seen(optimizer, state=True).state
        assert plan.run(optimizer, entry_for(optimizer), one, store.step_plans, store, [], found, now, param)
        param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        with AtenOps() as counted:
            assert plan.run(optimizer, entry_for(optimizer), one, store.step_plans, store, [], found, now, param)
        assert counted.ops == []


def test_the_cuda_plan_launches_what_a_fresh_table_would_under_tritons_interpreter(monkeypatch):
    """The Triton path's plan (address table patched with each step's gradients, both dtypes split into two
    launches, step counts by foreach ops) against the same kernel given a table made from scratch every step."""
    pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")
    from lightning_mp.kernels import cuda

    if torch.cuda.is_available():
        pytest.skip("the GPU runs the compiled kernel: tests/test_onepass.py")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cuda, "_kernels", {})
    assert native.cuda_kernel() is not None
    monkeypatch.setattr(plan, "_kernel_for", lambda params: "cuda")
    planned, fresh = _model(), _model()
    stores = []
    for model in (planned, fresh):
        store = RemainderMasters()
        store.convert(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        store.attach([optimizer])
        stores.append((store, optimizer))
    generator = torch.Generator().manual_seed(2)
    update = cuda.CudaLeanUpdate()
    for index in range(3):
        for param, other in zip(planned.parameters(), fresh.parameters()):
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            param.grad, other.grad = grad, grad.clone()
        if index == 2:  # the second Linear's weight accumulated in fp32: two launches
            RemainderMasters._widen_grad(planned[2].weight.grad)
            RemainderMasters._widen_grad(fresh[2].weight.grad)
        stores[0][0].fused_step(stores[0][1], None)
        _fresh_step(*stores[1], update)
    for param, other in zip(planned.parameters(), fresh.parameters()):
        assert torch.equal(_exact(stores[0][0], param), _exact(stores[1][0], other))


def _fresh_step(store, optimizer, update):
    """What the CUDA one-pass update did before plans: every row and step list made again for this step."""
    from lightning_mp.master.lean.optimizers import ADAM, state_for

    group = optimizer.param_groups[0]
    params = [p for p in group["params"] if p.grad is not None]
    states = [state_for(ADAM, optimizer, p, group) for p in params]
    torch._foreach_add_([s["step"] for s in states], 1)
    options = dict(kind=native.ADAMW, amsgrad=False, maximize=False, lr=1e-2, beta1=0.9, beta2=0.999,
                   weight_decay=0.1, eps=1e-8, clamped=False, clamp=-1.0)  # fmt: skip
    for fp32 in (False, True):
        rows, steps = [], []
        for param, state in zip(params, states):
            offset = store.offset_of(param)
            if offset is None or (param.grad.dtype == torch.float32) != fp32:
                continue
            high, low = store.flat_slices(param.device, offset, offset + param.numel())
            rows.append([high.data_ptr(), low.data_ptr(), param.grad.data_ptr(), state["exp_avg"].data_ptr(),
                         state["exp_avg_sq"].data_ptr(), 0, param.numel()])  # fmt: skip
            steps.append(state["step"])
        if rows:
            update.run(fp32, rows, steps, {**options, "grad_fp32": fp32}, None, None, torch.device("cpu"))
    plain = [(p, s) for p, s in zip(params, states) if store.offset_of(p) is None]
    torch._fused_adamw_(
        [p.detach() for p, _ in plain], [p.grad for p, _ in plain], [s["exp_avg"] for _, s in plain],
        [s["exp_avg_sq"] for _, s in plain], [], [s["step"] for _, s in plain], amsgrad=False, lr=1e-2, beta1=0.9,
        beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False, grad_scale=None, found_inf=None,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# What users do to an optimizer between steps: the plan reads what torch's optimizer reads, or refuses before any
# update. Each edit is made the same way on the lean optimizer and on the reference (torch's fused optimizer on fp32
# parameters holding the exact values); the lean run must stay bitwise the reference through the edit and after it.


def _layer_params(optimizer, first, last):
    return [p for g in optimizer.param_groups for p in g["params"]][first:last]


def _assign_exp_avg(optimizer, params, memo):
    for p in params[:2]:
        optimizer.state[p]["exp_avg"] = torch.full_like(optimizer.state[p]["exp_avg"], 1e-3)


def _assign_step(optimizer, params, memo):
    for p in params:
        optimizer.state[p]["step"] = torch.tensor(1.0)


def _reset_every_state(optimizer, params, memo):
    for p in params:
        optimizer.state[p] = {}


def _clear_one_layer(optimizer, params, memo):
    for p in params[:2]:
        optimizer.state[p].clear()


def _update_one_state(optimizer, params, memo):
    state = optimizer.state[params[2]]
    state.update({key: torch.zeros_like(value) for key, value in state.items() if key != "step"})


def _restore_from_copy(optimizer, params, memo):
    if "saved" not in memo:  # taken at the first edit, restored at the second
        memo["saved"] = {p: copy.deepcopy(dict(optimizer.state[p])) for p in params}
        return
    for p in params:
        optimizer.state[p] = copy.deepcopy(memo["saved"][p])


def _swap_storage(optimizer, params, memo):
    for p in params:
        for key, value in optimizer.state[p].items():
            if key != "step":
                value.data = torch.full_like(value, 2e-4)
        if "step" in optimizer.state[p]:
            optimizer.state[p]["step"].data = torch.tensor(5.0)


def _zero_in_place(optimizer, params, memo):
    for p in params:
        for key, value in optimizer.state[p].items():
            if key != "step":
                value.zero_()


def _extend_params(optimizer, params, memo):
    if "done" not in memo:
        memo["done"] = True
        optimizer.param_groups[0]["params"].extend(memo["late"])


def _drop_a_parameter(optimizer, params, memo):
    if "done" not in memo:
        memo["done"] = True
        dropped = optimizer.param_groups[0]["params"].pop(0)
        optimizer.state.pop(dropped)  # torch's state_dict() cannot name the state of a parameter in no group


def _permute_params(optimizer, params, memo):
    optimizer.param_groups[0]["params"].reverse()


def _momentum_to_none(optimizer, params, memo):
    for p in params:
        optimizer.state[p]["momentum_buffer"] = None


def _momentum_replaced(optimizer, params, memo):
    for p in params[1:3]:
        optimizer.state[p]["momentum_buffer"] = torch.full_like(optimizer.state[p]["momentum_buffer"], 0.01)


ADAM_EDITS = [_assign_exp_avg, _assign_step, _reset_every_state, _clear_one_layer, _update_one_state,
              _restore_from_copy, _swap_storage, _zero_in_place, _extend_params, _drop_a_parameter, _permute_params]  # fmt: skip
# (no parameter added in place: torch's fused SGD, the reference, cannot take a momentum buffer made later)
SGD_EDITS = [_momentum_to_none, _momentum_replaced, _restore_from_copy, _swap_storage, _permute_params,
             _reset_every_state]  # fmt: skip


@pytest.mark.parametrize(
    ("optimizer_cls", "kwargs", "edit"),
    [(torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), e) for e in ADAM_EDITS]
    + [(torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3), e) for e in SGD_EDITS],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_the_plan_follows_what_users_do_to_the_optimizer_between_steps(optimizer_cls, kwargs, edit):
    model, reference, store, optimizer, ref_optimizer = _setup(
        optimizer_cls, kwargs, params=lambda m: [p for layer in list(m)[:3] for p in layer.parameters()]
    )
    generator = torch.Generator().manual_seed(3)
    memos = ({"late": list(model[3].parameters())}, {"late": list(reference[3].parameters())})
    for index in range(6):
        _grads(model, reference, generator, skip=())
        if index in (2, 4):
            for opt, memo in zip((optimizer, ref_optimizer), memos):
                edit(opt, [p for g in opt.param_groups for p in g["params"]], memo)
        _step(store, optimizer, ref_optimizer)
        _assert_same(model, reference, store, optimizer, ref_optimizer)


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_state_the_kernel_cannot_read_is_refused_by_name_before_any_update(key):
    model, reference, store, optimizer, ref_optimizer = _setup(torch.optim.AdamW, dict(lr=1e-2))
    generator = torch.Generator().manual_seed(4)
    _grads(model, reference, generator, skip=())
    _step(store, optimizer, ref_optimizer)
    _grads(model, reference, generator, skip=())
    param = model[2].weight
    optimizer.state[param][key] = torch.zeros_like(param)  # bf16: the natural slip
    before = [store.fp32_value(p).clone() if p.dtype == torch.bfloat16 else p.detach().clone() for p in model.parameters()]  # fmt: skip
    with pytest.raises(ValueError, match=rf"state\[param\]\['{key}'\].*torch.bfloat16.*Nothing was updated"):
        store.fused_step(optimizer, None)
    after = [store.fp32_value(p) if p.dtype == torch.bfloat16 else p.detach() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    optimizer.state[param][key] = torch.zeros_like(param, dtype=torch.float32)
    optimizer.state[param].pop("exp_avg_sq" if key == "exp_avg" else "exp_avg")
    with pytest.raises(KeyError, match="partly cleared"):
        store.fused_step(optimizer, None)


def test_a_parameter_put_in_a_group_by_hand_must_be_the_models():
    model, reference, store, optimizer, ref_optimizer = _setup(torch.optim.AdamW, dict(lr=1e-2))
    stranger = nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    generator = torch.Generator().manual_seed(5)
    _grads(model, reference, generator, skip=())
    _step(store, optimizer, ref_optimizer)
    optimizer.param_groups[0]["params"][0] = stranger  # same length: no add_param_group, no size change
    stranger.grad = torch.ones_like(stranger)
    _grads(model, reference, generator, skip=())
    with pytest.raises(ValueError, match="not one of its parameters.*Nothing was updated"):
        store.fused_step(optimizer, None)


def test_a_released_plan_releases_its_tensors():
    """A plan of a group that left the optimizer, or of a state replaced by a resume, holds nothing afterwards."""
    model, reference, store, optimizer, ref_optimizer = _setup(torch.optim.AdamW, dict(lr=1e-2))
    generator = torch.Generator().manual_seed(6)
    _grads(model, reference, generator, skip=())
    _step(store, optimizer, ref_optimizer)
    first = id(optimizer.param_groups[0])
    assert first in store.step_plans
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _grads(model, reference, generator, skip=())
    store.fused_step(optimizer, None)
    assert list(store.step_plans) == [id(optimizer.param_groups[0])]
    now = following.seen(optimizer, state=True).state  # the plans left are laid out on the current state
    assert all(made.generation == now for made in store.step_plans.values())
