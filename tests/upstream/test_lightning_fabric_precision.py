"""Lightning's Fabric precision tests (``tests/tests_fabric/plugins/precision/``) ported to our plugin in
``L.Fabric(plugins=[MixedPrecisionPlugin(...)])``. Each test's docstring names its upstream file and test and says
what was adapted. Upstream tests Fabric's ``MixedPrecision`` with mocks of its ``torch.amp.GradScaler``; ours drive
the real plugin (its scaler is our :class:`~lightning_mp.DynamicLossScaler`) through a real Fabric on CPU, where our
fp16 really runs (Fabric's ``16-mixed`` turns into bf16 on CPU).
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from tests.upstream._helpers import run_in_two_processes

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _fabric(plugin: MixedPrecisionPlugin, **kwargs: Any) -> L.Fabric:
    return L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], **kwargs)


# ------------------------------------------------------------------ test_amp.py
def test_amp_precision_default_scaler():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_default_scaler: ``16-mixed`` gets a
    dynamic loss scaler by default (ours instead of ``torch.amp.GradScaler``)."""
    plugin = MixedPrecisionPlugin("16-mixed")
    assert isinstance(plugin.scaler, DynamicLossScaler) and plugin.scaler.dynamic and not plugin.scaler.check_only


def test_amp_precision_scaler_with_bf16():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_scaler_with_bf16.

    Adapted: upstream refuses any scaler with bf16 and has none by default. Ours refuses a loss *scale* with bf16 and
    by default keeps a check-only scaler (no scaling; a non-finite step is skipped); ``{"enabled": False}`` is
    upstream's "no scaler"."""
    with pytest.raises(ValueError, match="bf16"):
        MixedPrecisionPlugin("bf16-mixed", scaler=DynamicLossScaler())
    assert MixedPrecisionPlugin("bf16-mixed").scaler.check_only
    plugin = MixedPrecisionPlugin("bf16-mixed", scaler={"enabled": False})
    assert plugin.scaler is None or not plugin.scaler.enabled


def test_amp_precision_forward_context():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_forward_context.

    Adapted: the fp16 half runs on CPU (upstream's on CUDA), through Fabric's ``autocast()``; the autocast device is
    where the model lives once Fabric set it up."""
    for precision, dtype in (("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)):
        plugin = MixedPrecisionPlugin(precision)
        fabric = _fabric(plugin)
        fabric.setup(nn.Linear(2, 2))
        assert plugin.device_type == "cpu"
        assert torch.get_default_dtype() == torch.float32
        with fabric.autocast():
            assert torch.get_autocast_dtype("cpu") == dtype
        context_manager = plugin.forward_context()
        assert isinstance(context_manager, torch.autocast)
        assert context_manager.fast_dtype == dtype


def test_amp_precision_backward():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_backward.

    Adapted: no mocks. The loss is scaled once (the gradients are ``scale`` times the true ones until unscaled) and
    ``fabric.backward``'s positional and keyword arguments reach ``tensor.backward`` (``retain_graph=True`` lets a
    second backward run)."""
    plugin = MixedPrecisionPlugin("16-mixed", scaler={"init_scale": 8.0})
    model = nn.Linear(2, 1)
    fabric = _fabric(plugin)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.ones(1, 2)
    loss = model(x).sum()
    fabric.backward(loss, None, retain_graph=True)  # backward(gradient=None, retain_graph=True)
    assert torch.equal(model.weight.grad, torch.full((1, 2), 8.0, dtype=model.weight.grad.dtype))
    fabric.backward(loss)  # the graph was retained
    assert torch.equal(model.weight.grad, torch.full((1, 2), 16.0, dtype=model.weight.grad.dtype))


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[dict[str, Any]] = []

    def step(self, closure: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        self.calls.append(kwargs)
        return super().step(closure)


def test_amp_precision_optimizer_step_with_scaler():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_optimizer_step_with_scaler.

    Adapted: no mocks. The optimizer's step gets the keyword arguments, and the scaler updates once per step (its
    growth tracker counts one finite step; at growth_interval=1 the scale doubles once)."""
    plugin = MixedPrecisionPlugin("16-mixed", scaler={"init_scale": 8.0, "growth_interval": 1})
    model = nn.Linear(2, 1)
    fabric = _fabric(plugin)
    model, optimizer = fabric.setup(model, _RecordingSGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(1, 2)).sum())
    fabric.strategy.optimizer_step(optimizer.optimizer, keyword="arg")
    assert optimizer.optimizer.calls == [{"keyword": "arg"}]
    assert plugin.scaler.scale == 16.0


def test_amp_precision_optimizer_step_without_scaler():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_optimizer_step_without_scaler: bf16
    with the check turned off steps the optimizer directly, with the keyword arguments."""
    plugin = MixedPrecisionPlugin("bf16-mixed", scaler={"enabled": False})
    model = nn.Linear(2, 1)
    fabric = _fabric(plugin)
    model, optimizer = fabric.setup(model, _RecordingSGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(1, 2)).sum())
    fabric.strategy.optimizer_step(optimizer.optimizer, keyword="arg")
    assert optimizer.optimizer.calls == [{"keyword": "arg"}]


def test_amp_precision_parameter_validation():
    """Port of tests_fabric/plugins/precision/test_amp.py::test_amp_precision_parameter_validation (ours names the
    bad value and the allowed ones)."""
    MixedPrecisionPlugin("16-mixed")  # should not raise exception
    MixedPrecisionPlugin("bf16-mixed")
    for bad in ("16", 16, "bf16"):
        allowed = "['16-mixed', 'bf16-mixed']"
        with pytest.raises(
            ValueError, match=re.escape(f"MixedPrecisionPlugin(precision={bad!r})") + ".*" + re.escape(allowed)
        ):
            MixedPrecisionPlugin(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ test_amp_integration.py
class MixedPrecisionModule(nn.Module):
    def __init__(self, expected_dtype: torch.dtype) -> None:
        super().__init__()
        self.expected_dtype = expected_dtype
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32  # adapted: ours leaves inputs as they are (autocast casts at the matmul)
        assert torch.is_autocast_enabled("cpu")
        output = self.layer(x)
        assert output.dtype == self.expected_dtype
        return output


def _test_amp(fabric: L.Fabric, expected_dtype: torch.dtype, master_weights: Any) -> None:
    model = MixedPrecisionModule(expected_dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)

    batch = torch.rand(2, 32, device=fabric.device)
    half = expected_dtype if master_weights else torch.float32
    assert model.layer.weight.dtype == half
    assert batch.dtype == torch.float32

    output = model(batch)
    assert output.dtype == torch.float32

    loss = torch.nn.functional.mse_loss(output, torch.ones_like(output))
    fabric.backward(loss)
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]  # where the optimizer reads them
    assert all(g.dtype == (torch.bfloat16 if master_weights == "remainder" else torch.float32) for g in grads)

    optimizer.step()
    optimizer.zero_grad()


def _amp_in_two_processes() -> None:
    for precision, dtype in (("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)):
        for masters in (False, True, "remainder") if precision == "bf16-mixed" else (False, True):
            plugin = MixedPrecisionPlugin(precision, master_weights=masters)
            fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
            fabric.launch()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _test_amp(fabric, dtype, masters)


def test_amp():
    """Port of tests_fabric/plugins/precision/test_amp_integration.py::test_amp (its CPU cases).

    Adapted: two real CPU processes (gloo) started once for both precisions, each Fabric joining them with the
    ``ddp`` strategy, instead of ``ddp_spawn`` starting them per case; fp16 really runs on CPU (upstream expects
    bf16 there); inputs stay fp32 (upstream's plugin casts them; ours, as on the Trainer path, lets autocast cast at
    the matmul); outputs leave the forward in fp32 as upstream's. Each precision also runs with fp32 master
    weights, bf16 with lean masters: the gradients are read where the optimizer reads them."""
    run_in_two_processes(_amp_in_two_processes)


@pytest.mark.parametrize("master_weights", [False, True])
def test_amp_fused_optimizer_parity(master_weights):
    """Port of tests_fabric/plugins/precision/test_amp_integration.py::test_amp_fused_optimizer_parity.

    Adapted: CPU (upstream: CUDA), our fp16 plugin (``precision=16`` upstream), a 10x10 Linear as upstream;
    x master_weights. Fused Adam skips on the device, the for-loop Adam on the host: the same losses and weights."""

    def run(fused: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
        L.seed_everything(1234)
        plugin = MixedPrecisionPlugin("16-mixed", master_weights=master_weights)
        fabric = _fabric(plugin)

        model = nn.Linear(10, 10).to(fabric.device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1.0, fused=fused)

        model, optimizer = fabric.setup(model, optimizer)
        assert isinstance(fabric._precision.scaler, DynamicLossScaler)

        data = torch.randn(10, 10)
        target = torch.randn(10, 10)

        losses = []
        for _ in range(5):
            optimizer.zero_grad()
            output = model(data)
            loss = (output - target).abs().sum()
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        return torch.stack(losses), [v.clone() for v in model.state_dict().values()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses, params = run(fused=False)
        losses_fused, params_fused = run(fused=True)

    # Both the regular and the fused version of Adam produce the same losses and model weights
    torch.testing.assert_close(losses, losses_fused)
    for p, q in zip(params, params_fused):
        torch.testing.assert_close(p, q)


# ------------------------------------------------------------------ test_all.py
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_default_dtype_is_restored(precision):
    """Port of tests_fabric/plugins/precision/test_all.py::test_default_dtype_is_restored.

    Adapted: upstream's half-precision plugins change the default dtype inside ``module_init_context`` and
    ``forward_context``; ours keeps fp32 as the default dtype (mixed precision) in both, and both are left cleanly
    after an exception: default dtype and autocast restored."""
    plugin = MixedPrecisionPlugin(precision)
    _fabric(plugin).setup(nn.Linear(2, 2))
    for context in (plugin.module_init_context, plugin.forward_context):
        assert torch.get_default_dtype() is torch.float32
        with pytest.raises(RuntimeError, match="foo"), context():
            raise RuntimeError("foo")
        assert torch.get_default_dtype() is torch.float32
        assert not torch.is_autocast_enabled("cpu")
