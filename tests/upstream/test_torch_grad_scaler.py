"""Ports of torch's GradScaler tests to ``DynamicLossScaler``, on CPU with fp16 autocast.

Sources (github:pytorch/pytorch): the ``test_grad_scaling_*`` / ``test_grad_scale_will_not_overflow`` /
``test_grad_scaler_pass_itself`` / ``test_params_invalidated_...`` tests of test/test_cuda.py (CUDA-only
before torch made them device-generic) and test/test_torch.py (device-generic), and their helpers
``_create_scaling_models_optimizers`` / ``_create_scaling_case`` (torch/testing/_internal/common_cuda.py) and
``_run_scaling_case``. torch's ``scaler.step(opt); scaler.update()`` becomes our explicit
``unscale_`` -> ``found_inf`` -> step unless non-finite -> ``update`` (docs/loss-scaling.md, "The scaler on its own").
See tests/upstream/README.md for what was ported and dropped.
"""

import math
import pickle
from itertools import chain, product

import pytest
import torch
from torch import nn

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from lightning_mp.master import MasterWeights
from tests.upstream._helpers import trainer_with

FP32_MAX = torch.finfo(torch.float32).max


# ---------------------------------------------------------------------------------------------------- helpers
def _create_scaling_models_optimizers(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Port of torch.testing._internal.common_cuda._create_scaling_models_optimizers: a module+optimizer that
    will use scaling, and a control module+optimizer without, with the same weights."""
    mod_control = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mod_scaling = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)

    kwargs = {"lr": 1.0}
    if optimizer_kwargs is not None:
        kwargs.update(optimizer_kwargs)
    opt_control = optimizer_ctor(mod_control.parameters(), **kwargs)
    opt_scaling = optimizer_ctor(mod_scaling.parameters(), **kwargs)
    return mod_control, mod_scaling, opt_control, opt_scaling


def _create_scaling_case(optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Port of torch.testing._internal.common_cuda._create_scaling_case (seeded here)."""
    torch.manual_seed(0)
    data = [(torch.randn((8, 8)), torch.randn((8, 8))) for _ in range(4)]
    loss_fn = nn.MSELoss()
    skip_iter = 2
    return _create_scaling_models_optimizers(optimizer_ctor, optimizer_kwargs) + (data, loss_fn, skip_iter)


def _params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _step(scaler, optimizer, found_inf=None):
    """torch's ``scaler.step(optimizer)``: unscale (unless ``found_inf`` says it was done), step unless
    non-finite. Returns whether the step was skipped; the caller runs ``scaler.update``."""
    if found_inf is None:
        found_inf = scaler.unscale_(_params(optimizer))
    skip = scaler.found_inf(found_inf)
    if not skip:
        optimizer.step()
    return skip


def _run_scaling_case(run, unskipped, skipped, atol=1e-7, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None):
    """Port of torch's ``_run_scaling_case``: run the control (no scaling) and the scaling model through
    ``run`` and compare scale, gradients, optimizer state and weights. Scaling can be disabled without
    changing the user's control flow."""
    for enabled in True, False:
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = _create_scaling_case(
            optimizer_ctor, optimizer_kwargs
        )

        # For functionality, test with a modest initial scale, and an unrealistically-large growth factor
        # so any potential errors with the growth factor handling will be magnified.
        scaler = DynamicLossScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

        _ = run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)

        # Allows run() to optionally return a different scaler instance.
        scaler = ret if ret else scaler

        # If scaling was enabled, the scale factor should have been multiplied by the growth factor
        # len(data) - skipped times and the backoff factor "skipped" times.
        if enabled:
            net_growth = scaler.growth_factor**unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.backoff_factor**skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == (128.0 * net_growth * net_backoff)
        else:
            assert scaler.get_scale() == 1.0

        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(c.grad, s.grad, atol=atol, rtol=1e-05)

            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                torch.testing.assert_close(c_state[k], s_state[k], atol=atol, rtol=1e-05, msg=k)

            torch.testing.assert_close(c, s, atol=atol, rtol=1e-05)


# ---------------------------------------------------------------------------------------------------- unscaling
def test_grad_scaling_unscale(dtype=torch.float):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_unscale (test_cuda.py before).

    Adapted: upstream drives the raw ``torch._amp_foreach_non_finite_check_and_unscale_`` kernel and
    ``GradScaler._unscale_grads_``; we drive ``DynamicLossScaler.unscale_``, which calls that kernel per device
    and dtype. The multi-GPU lines of the perfect storm need two GPUs: not ported.
    """
    scaler = DynamicLossScaler(init_scale=4.0)  # unscaling multiplies by 0.25

    size = 20
    g = torch.full((size, size), 4.0, dtype=dtype)
    ginf = g.clone()
    ginf[2, 2] = float("inf")
    gnan = g.clone()
    gnan[2, 2] = float("nan")

    # Tries selected combinations of contiguous grads, g.clone().t() (not contiguous but non-overlapping and
    # dense) and variants of g.clone()[:, :5] (not non-overlapping and dense): the kernel has a multi-tensor
    # path and a per-tensor fallback, so we try both.
    cases = (
        ([g.clone(), g.clone()], False),
        ([g.clone(), g.clone().t()], False),
        ([g.clone(), g.clone()[:, :5]], False),
        ([g.clone()[:, :5], g.clone()[:, :5]], False),
        ([g.clone(), ginf.clone()], True),
        ([g.clone(), gnan.clone()], True),
        ([g.clone(), ginf.clone()[:, :5]], True),
        ([g.clone(), gnan.clone()[:, :5]], True),
        ([ginf.clone(), g.clone()[:, :5]], True),
        ([ginf.clone()[:, :5], g.clone()[:, :5]], True),
    )

    def with_grads(grads):
        params = [nn.Parameter(torch.empty_like(grad)) for grad in grads]
        for p, grad in zip(params, grads):
            p.grad = grad
        return params

    for grads, has_inf in cases:
        found_inf = scaler.unscale_(with_grads(grads))
        if has_inf:
            assert found_inf.item() == 1.0
        else:
            assert found_inf.item() == 0.0
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # mismatched dtypes in one call
    grads = [g.clone(), g.to(dtype=torch.float16)]
    scaler.unscale_(with_grads(grads))
    for grad in grads:
        torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)

    # A list of grads with mismatched dtypes and layouts, to ensure unscale_ organises them by dtype and device.
    # If inject_inf >= 0, writes an inf into one grad for unscale_ to find.
    def perfect_storm_grads(inject_inf):
        grads = [g.clone(), g.clone()[:, :5], g.to(dtype=torch.float16), g.to(dtype=torch.float16)]
        if inject_inf >= 0:
            grads[inject_inf][2, 2] = float("inf")
        return grads

    dummy_params = [nn.Parameter(torch.empty_like(grad)) for grad in perfect_storm_grads(-1)]

    # Ensures the inf/nan checking can find an inf injected onto any grad in the perfect storm.
    for inject_inf in range(-1, len(dummy_params)):
        grads = perfect_storm_grads(inject_inf)
        for i, p in enumerate(dummy_params):
            p.grad = grads[i]
        found_inf = scaler.unscale_(dummy_params)
        if inject_inf < 0:
            # No inf was injected, ensures unscaling worked normally.
            assert found_inf.item() == 0
            for grad in grads:
                torch.testing.assert_close(grad, torch.ones_like(grad), rtol=1e-5, atol=1e-7)
        else:
            # inf was injected, ensures inf was found.
            assert found_inf.item() == 1


def test_grad_scaling_update_scale():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_update_scale (test_cuda.py before).

    Adapted: upstream drives the raw ``torch._amp_update_scale_`` kernel; we drive ``update`` and read the
    growth tracker from ``state_dict``.
    """
    scaler = DynamicLossScaler(init_scale=4.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)

    # Simulates 2 consecutive unskipped iterations
    scaler.update(False)
    assert scaler.state_dict()["growth_tracker"] == 1
    assert scaler.scale == 4.0
    scaler.update(False)
    assert scaler.state_dict()["growth_tracker"] == 0
    assert scaler.scale == 8.0

    # Simulates a skipped iteration
    scaler.update(True)
    assert scaler.state_dict()["growth_tracker"] == 0
    assert scaler.scale == 2.0


def test_grad_scaling_unscale_sparse():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_unscale_sparse (test_cuda.py before)."""
    scaler = DynamicLossScaler(init_scale=4.0)

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], dtype=torch.float)
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), dtype=torch.float)

    p = s.clone()
    assert p.is_sparse

    p.grad = s.clone()
    assert scaler.unscale_([p]).item() == 0.0
    torch.testing.assert_close(p.grad.to_dense(), (s / 4).to_dense())

    v = torch.tensor([16.0, 32.0, float("inf")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), dtype=torch.float)
    assert scaler.unscale_([p]).item() == 1.0

    v = torch.tensor([16.0, 32.0, float("nan")])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), dtype=torch.float)
    assert scaler.unscale_([p]).item() == 1.0

    p = s.clone().half()
    assert p.is_sparse

    p.grad = s.clone().half()
    assert scaler.unscale_([p]).item() == 0.0
    torch.testing.assert_close(p.grad.to_dense(), (s.half() / 4).to_dense())

    # Creates fp16 sparse tensor with duplicated indices (uncoalesced). The uncoalesced representation
    # does not overflow in fp16, but the coalesced representation would, because 64000 + 64000 > fp16 max.
    # unscale_ should report an overflow here.
    i = torch.tensor([[0, 1, 0], [2, 0, 2]], dtype=torch.int64)
    v = torch.tensor([64000.0, 32.0, 64000.0])
    p.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), dtype=torch.float16)
    assert scaler.unscale_([p]).item() == 1.0


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(lazy_init_scale):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_state_dict (test_cuda.py before).

    Adapted: upstream sets the private ``_init_growth_tracker`` of the receiving scaler; we give it a
    non-zero growth tracker with a finite step. "Lazily initialised" is our scale tensor, made by
    ``scale_loss``: after loading, scaling uses the loaded scale.
    """
    s0 = DynamicLossScaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = DynamicLossScaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=3)

    # sets a value for load_state_dict to overwrite
    s1.update(False)
    assert s1.state_dict()["growth_tracker"] == 1

    if lazy_init_scale:
        # Dummy scale_loss() call to ensure the scale tensor is lazily initialized.
        assert s1.scale_loss(torch.full((1,), 4.0, dtype=torch.float32)).item() == 24.0

    s1.load_state_dict(s0.state_dict())

    assert s1.get_scale() == 3.0
    assert s1.growth_factor == 4.0
    assert s1.backoff_factor == 0.5
    assert s1.growth_interval == 2
    assert s1.state_dict()["growth_tracker"] == 0
    assert s1.scale_loss(torch.full((1,), 4.0, dtype=torch.float32)).item() == 12.0


# ---------------------------------------------------------------------------------------------------- training
def _grad_scaling_autocast_run(try_pickle=False, masters=False):
    """torch's ``_grad_scaling_autocast_test``'s ``run``: fp16 autocast + scaling against fp32 without either.
    With ``masters``, the scaling model is held in fp16 with fp32 master weights (our ``MasterWeights``)."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        master_weights = None
        if try_scaling_api and masters:
            master_weights = MasterWeights(torch.float16)
            master_weights.convert(model)
            master_weights.attach([optimizer])
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=try_scaling_api):
                output = model(input)
                loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale_loss(loss).backward()
                if master_weights is not None:
                    master_weights.grads_to_masters()
                if i == skip_iter and scaler.enabled:
                    with torch.no_grad():
                        weight = model[1].weight
                        target_grad = weight.grad if master_weights is None else master_weights.master_of(weight).grad
                        target_grad.fill_(float("inf"))
                skip = _step(scaler, optimizer)
                if master_weights is not None and not skip:
                    master_weights.masters_to_model(optimizer)
                scaler.update(skip)
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            else:
                loss.backward()
                if (not scaler.enabled) or (i != skip_iter):
                    optimizer.step()
        if master_weights is not None:
            # the comparison reads the masters' values, gradients and optimizer state: put them on the model
            grads = [(param, master.grad) for param, master in master_weights.pairs()]
            master_weights.restore()
            for param, grad in grads:
                param.grad = grad
        return scaler

    return run


@pytest.mark.parametrize("master_weights", [False, True])
@pytest.mark.parametrize("try_pickle", [False, True])
@pytest.mark.parametrize("optimizer_kwargs", [None, {"foreach": True}], ids=["sgd", "sgd-foreach"])
def test_grad_scaling_autocast(optimizer_kwargs, try_pickle, master_weights):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_autocast (SGD) and
    test_grad_scaling_autocast_foreach (SGD; test_cuda.py before). Compares no scaling + no autocasting
    against scaling + fp16 autocasting, the scaler pickled after every step or not.

    Adapted: CPU fp16 autocast; master weights added. Adam/AdamW not ported: upstream itself expects this
    comparison to fail for them (it wraps them in ``assertRaises(AssertionError)``).
    """
    # atol=1e-3 because we're comparing pure fp32 arithmetic vs a mixture of fp16 and fp32
    _run_scaling_case(
        _grad_scaling_autocast_run(try_pickle, master_weights),
        unskipped=3,
        skipped=1,
        atol=1e-3,
        optimizer_kwargs=optimizer_kwargs,
    )


@pytest.mark.parametrize(
    ("optimizer_ctor", "optimizer_kwargs"),
    list(
        product(
            (torch.optim.Adam, torch.optim.AdamW), ({"fused": True, "amsgrad": False}, {"fused": True, "amsgrad": True})
        )
    ),
)
def test_grad_scaling_autocast_fused_optimizers(optimizer_ctor, optimizer_kwargs):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_autocast_fused_optimizers
    (test_cuda.py before): a fused optimizer against its unfused version, both under the scaler.

    Adapted: upstream's ``separate_unscale`` True/False collapses to one case: we always unscale before
    ``step()`` (a fused optimizer never unscales inside its kernel), so both of its cases are this one.
    """
    mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, _ = _create_scaling_case(
        optimizer_ctor, optimizer_kwargs
    )
    kwargs = dict(optimizer_kwargs)
    kwargs["fused"] = False
    opt_control = optimizer_ctor(mod_control.parameters(), lr=1.0, **kwargs)

    scaler = DynamicLossScaler(init_scale=128.0)

    for input, target in data:
        opt_control.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output_control = mod_control(input)
            loss_control = loss_fn(output_control, target)
        scaler.scale_loss(loss_control).backward()
        scaler.update(_step(scaler, opt_control))

        opt_scaling.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            output_scaling = mod_scaling(input)
            loss_scaling = loss_fn(output_scaling, target)
        scaler.scale_loss(loss_scaling).backward()
        scaler.update(_step(scaler, opt_scaling))

        torch.testing.assert_close(loss_control, loss_scaling)
        for param_control, param_scaling in zip(mod_control.parameters(), mod_scaling.parameters()):
            torch.testing.assert_close(param_control.grad, param_scaling.grad)
            torch.testing.assert_close(param_control, param_scaling)

            state_control, state_scaling = opt_control.state[param_control], opt_scaling.state[param_scaling]

            for k in state_control:
                actual = state_scaling[k]
                if k == "step":
                    actual = actual.squeeze()
                torch.testing.assert_close(state_control[k], actual)


@pytest.mark.parametrize(
    ("optimizer_ctor", "optimizer_kwargs"),
    list(
        product(
            (torch.optim.Adam, torch.optim.AdamW),
            ({"foreach": False, "fused": False}, {"foreach": True, "fused": False}, {"foreach": False, "fused": True}),
        )
    ),
)
def test_params_invalidated_with_grads_invalidated_between_unscale_and_step(optimizer_ctor, optimizer_kwargs):
    """Port of test/test_torch.py::TestTorchDeviceType::test_params_invalidated_with_grads_invalidated_between_unscale_and_step
    (test_cuda.py before).

    The parameters become nonsense when the scaled gradients are finite but are broken after ``unscale_``
    and before the step: the check is the one ``unscale_`` made, as in torch.
    """
    model, _, optimizer, _, data, loss_fn, _ = _create_scaling_case(optimizer_ctor, optimizer_kwargs)
    scaler = DynamicLossScaler(init_scale=128.0)

    for input, target in data:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=True):
            output = model(input)
            loss = loss_fn(output, target)
        scaler.scale_loss(loss).backward()
        found_inf = scaler.unscale_(model.parameters())

        # deliberately break grads
        for j, param in enumerate(model.parameters()):
            param.grad.copy_(torch.inf if j % 2 else torch.nan)

        scaler.update(_step(scaler, optimizer, found_inf))

    assert all((p.isnan().any() or p.isinf().any()) for p in model.parameters())


def test_grad_scale_will_not_overflow():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scale_will_not_overflow (test_cuda.py before).

    A scale next to fp32's largest value, growing by 16 every step, stays finite. Adapted: upstream's
    ``init_scale=1e38`` is above our default ``max_scale`` (2**24) and refused, so ``max_scale`` is fp32's
    largest value here; test_grad_scale_settings_beyond_fp32_are_refused covers ``max_scale`` beyond it.
    """
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = DynamicLossScaler(growth_interval=1, growth_factor=2**4, init_scale=1e38, max_scale=FP32_MAX)
    optimizer.zero_grad()
    x = torch.randn(1, 5)
    y = 1e-30 * torch.randn(1, 1)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale_loss(loss).backward()
    scaler.update(_step(scaler, optimizer))
    assert math.isfinite(scaler.scale)
    assert scaler.scale <= FP32_MAX
    assert torch.isfinite(scaler.scale_loss(torch.ones((), dtype=torch.float32)))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(init_scale=1e38, growth_factor=2**4, growth_interval=1, max_scale=1e300), "max_scale"),
        (dict(init_scale=1e39, max_scale=1e40), "init_scale|max_scale"),
        (dict(init_scale=1e39), "init_scale"),
    ],
)
def test_grad_scale_settings_beyond_fp32_are_refused(kwargs, name):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scale_will_not_overflow, for the settings that
    would overflow: a scale lives in an fp32 tensor, so a ``max_scale`` or ``init_scale`` beyond fp32's largest
    value is refused at construction with a ValueError naming it, rather than accepted and crashing (or
    overflowing) when the scale grows there.
    """
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


def test_grad_scaling_clipping():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_clipping (test_cuda.py before):
    clipping the *scaled* gradients by ``max_norm * scale`` before the step."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale_loss(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
                if i == skip_iter and scaler.enabled:
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.update(_step(scaler, optimizer))
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.enabled) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_clipping_separate_unscale
    (test_cuda.py before): unscale first, then clip the true gradients."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # A reasonable value that actually has an effect, based on printouts of grads
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)
            if try_scaling_api:
                scaler.scale_loss(loss).backward()
                if i == skip_iter and scaler.enabled:
                    model[1].weight.grad.data.fill_(float("inf"))
                found_inf = scaler.unscale_(model.parameters())
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
                scaler.update(_step(scaler, optimizer, found_inf))
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                if (not scaler.enabled) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_grad_scaling_penalty():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_penalty (test_cuda.py before):
    a gradient penalty computed from ``autograd.grad`` of the scaled loss, unscaled by hand."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            output = model(input)
            loss = loss_fn(output, target)

            if try_scaling_api:
                grad_params = torch.autograd.grad(scaler.scale_loss(loss), model.parameters(), create_graph=True)
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)

            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm

            if try_scaling_api:
                scaler.scale_loss(loss).backward()
                if i == skip_iter and scaler.enabled:
                    model[1].weight.grad.data.fill_(float("inf"))
                scaler.update(_step(scaler, optimizer))
            else:
                loss.backward()
                if (not scaler.enabled) or (i != skip_iter):
                    optimizer.step()

    _run_scaling_case(run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation():
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_accumulation (test_cuda.py before):
    two scaled backwards per optimizer step, one unscale."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            output = model(input)
            loss = loss_fn(output, target)
            loss = loss / iters_to_accumulate
            if try_scaling_api:
                scaler.scale_loss(loss).backward()
            else:
                loss.backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.update(_step(scaler, optimizer))
                    optimizer.zero_grad()
                else:
                    optimizer.step()
                    optimizer.zero_grad()

    _run_scaling_case(run, unskipped=2, skipped=0)


@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(enabled):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaling_multiple (test_cuda.py before).

    Gradient scaling with 2 models and 2 optimizers that both receive gradients from 2 losses; only the
    optimizer whose gradients overflowed skips its step, and the scale is updated once per iteration.
    """
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = _create_scaling_case()
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers()

    scaler = DynamicLossScaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0 = model0(input)
            output1 = model1(input)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)

            if try_scaling_api:
                scaler.scale_loss(loss0).backward(retain_graph=True)
                scaler.scale_loss(loss1).backward()
                if i == skip_iter and scaler.enabled:
                    model1[1].weight.grad.data.fill_(float("inf"))

                # As an additional stress test, separately unscale for one of the optimizers.
                found_inf0 = scaler.unscale_(model0.parameters())

                skip0 = _step(scaler, optimizer0, found_inf0)
                skip1 = _step(scaler, optimizer1)
                scaler.update(skip0 or skip1)
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if (not scaler.enabled) or (i != skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)

    # The loss scale should have been multiplied by the growth factor 3 times and the backoff factor once.
    assert scaler.get_scale() == (128.0 * scaler.growth_factor**3 * scaler.backoff_factor**1 if enabled else 1.0)

    for c, s in zip(
        chain(mod_control0.parameters(), mod_control1.parameters()),
        chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
    ):
        torch.testing.assert_close(c, s, rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------------------------------- the plugin
class _PlaceHolderOptimizer(torch.optim.Optimizer):
    def __init__(self, params, defaults=None):
        super().__init__(params, defaults or {})
        self._step_supports_amp_scaling = True


@pytest.mark.parametrize("device_path", [True, False], ids=["accelerator-path", "cpu-default"])
@pytest.mark.parametrize("master_weights", [False, True])
def test_grad_scaler_pass_itself(master_weights, device_path, monkeypatch):
    """Port of test/test_torch.py::TestTorchDeviceType::test_grad_scaler_pass_itself (test_cuda.py before).

    Adapted to the plugin: torch hands an optimizer that declares ``_step_supports_amp_scaling`` the scaler
    (``grad_scaler=``, deprecated) or ``grad_scale``/``found_inf`` attributes, and lets it unscale inside its step.
    Ours never hands over a scaler: the optimizer with a ``grad_scaler`` argument gets a plain ``step()`` (no
    attributes; its step is decided on the host). The other, on the path taken on accelerators, gets torch's
    attributes as torch sets them after an ``unscale_``: ``grad_scale`` ``None`` (gradients already unscaled) and
    ``found_inf`` a 0-dim fp32 flag (here 0), removed after the step, and skips on the device; on CPU by default
    the flag is read on the host (no device to wait for) and it gets a plain ``step()``. Both find gradients
    already unscaled (the gradients of ``on_after_backward`` divided by the scale).
    """
    from lightning_mp import stepping

    monkeypatch.setattr(stepping, "DECIDE_CPU_FLAGS_ON_HOST", not device_path)
    seen = []

    class Optimizer1(_PlaceHolderOptimizer):
        def step(self, closure=None, *, grad_scaler=None):
            assert grad_scaler is None
            assert not hasattr(self, "grad_scale")
            assert not hasattr(self, "found_inf")
            seen.append([p.grad.clone() for group in self.param_groups for p in group["params"]])

    class Optimizer2(_PlaceHolderOptimizer):
        def step(self, closure=None):
            if device_path:
                assert self.grad_scale is None
                assert self.found_inf.shape == () and self.found_inf.dtype == torch.float32
                assert self.found_inf.item() == 0
            else:
                assert not hasattr(self, "grad_scale") and not hasattr(self, "found_inf")
            seen.append([p.grad.clone() for group in self.param_groups for p in group["params"]])

    from lightning.pytorch import LightningModule

    class Model(LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            # upstream's two optimizers share one Linear; each gets its own here, since each `opt.step()`
            # unscales its own parameters' gradients (sharing them would unscale them twice, in torch too)
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 1)
            self.expected = []

        def training_step(self, batch, batch_idx):
            o1, o2 = self.optimizers()
            loss = self.b(self.a(batch[0])).mean()
            self.manual_backward(loss)
            o1.step()
            o2.step()

        def on_after_backward(self):
            scale = self.trainer.scaler.scale
            self.expected = [[p.grad.float() / scale for p in layer.parameters()] for layer in (self.a, self.b)]

        def configure_optimizers(self):
            return Optimizer1(self.a.parameters()), Optimizer2(self.b.parameters())

    torch.manual_seed(0)
    model = Model()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 4)), batch_size=4)
    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", scaler=DynamicLossScaler(init_scale=2.0), master_weights=master_weights),
        max_steps=1,
    )
    trainer.fit(model, data)
    assert len(seen) == 2
    optimizers = trainer.optimizers
    assert not any(hasattr(o, name) for o in optimizers for name in ("grad_scale", "found_inf"))  # removed after
    for grads, expected_grads in zip(seen, model.expected):
        for actual, expected in zip(grads, expected_grads):
            torch.testing.assert_close(actual, expected)
