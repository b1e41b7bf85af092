"""Ports of Lightning's precision-plugin unit tests (tests/tests_pytorch/plugins/precision/) to our plugin.

Sources: test_amp.py, test_all.py, test_half.py and test_fsdp.py of github:Lightning-AI/pytorch-lightning.
Lightning's ``HalfPrecision`` ("16-true") holds the model in half precision; our equivalent is
``master_weights=True``, so the test_half.py ports run with master weights. See tests/upstream/README.md for
what was ported and what was dropped, and why.
"""

from unittest.mock import patch

import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import GradClipAlgorithmType
from packaging.version import Version
from torch import nn

from lightning_mp import CastPolicy, DynamicLossScaler, MixedPrecisionPlugin
from tests.upstream._helpers import on_cpu, trainer_with

PRECISIONS = [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)]
_TORCH_GREATER_EQUAL_2_11 = Version(torch.__version__.split("+")[0]) >= Version("2.11")


def test_clip_gradients():
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_clip_gradients.

    `.clip_gradients()` is a no-op when clipping is disabled, and routes to the chosen algorithm otherwise.
    Upstream passes a mocked optimizer; ours unscales before clipping, so it gets a real one.
    """
    layer = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    precision = MixedPrecisionPlugin(precision="16-mixed")
    with (
        patch.object(precision, "clip_grad_by_value") as by_value,
        patch.object(precision, "clip_grad_by_norm") as by_norm,
    ):
        precision.clip_gradients(optimizer)
        by_value.assert_not_called()
        by_norm.assert_not_called()

        precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
        by_value.assert_called_once()
        by_norm.assert_not_called()

        by_value.reset_mock()
        by_norm.reset_mock()

        precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
        by_value.assert_not_called()
        by_norm.assert_called_once()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_optimizer_amp_scaling_support_in_step_method(precision):
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_optimizer_amp_scaling_support_in_step_method.

    Adapted: Lightning refuses to clip for an optimizer that unscales inside its own ``step``
    (``_step_supports_amp_scaling``) when a GradScaler is present. Ours unscales before every ``step()``, so
    clipping works with and without a scaler: clip_grad_by_norm is called once and clips the *unscaled*
    gradients (checked against the fp32 gradients clipped by torch).
    """
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    reference = nn.Linear(4, 3)
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(8, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    optimizer._step_supports_amp_scaling = True
    plugin = MixedPrecisionPlugin(precision=precision)

    loss = layer(x).pow(2).sum()
    (plugin.scaler.scale_loss(loss) if plugin.scaler is not None else loss).backward()
    reference(x).pow(2).sum().backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)

    with patch.object(plugin, "clip_grad_by_norm", wraps=plugin.clip_grad_by_norm) as by_norm:
        plugin.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    by_norm.assert_called_once()
    for p, r in zip(layer.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_amp_with_no_grad(precision):
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_amp_with_no_grad (and, with 16-mixed,
    of test_amp_with_no_grad_cuda: our fp16 autocast runs on CPU).

    A ``no_grad`` block inside the plugin's forward context does not break gradient tracking after it.
    """
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = on_cpu(MixedPrecisionPlugin(precision=precision))

    with amp.forward_context():
        with torch.no_grad():
            _ = layer(x)

        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_amp_with_inference_mode(precision):
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_amp_with_inference_mode."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = on_cpu(MixedPrecisionPlugin(precision=precision))

    with amp.forward_context():
        with torch.inference_mode():
            _ = layer(x)

        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


def test_amp_forward_context_restores_grad_mode_context_managers():
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_amp_forward_context_restores_grad_mode_context_managers.

    Adapted: Lightning replaces ``torch.no_grad``/``torch.inference_mode`` inside its context (an internal of its
    no-grad workaround) and restores them on exit. Ours runs autocast without its cache instead and never
    touches them: they are the originals inside the context and after it.
    """
    amp = on_cpu(MixedPrecisionPlugin(precision="bf16-mixed"))
    original_no_grad = torch.no_grad
    original_inference_mode = torch.inference_mode

    with amp.forward_context():
        assert torch.no_grad is original_no_grad
        assert torch.inference_mode is original_inference_mode

    assert torch.no_grad is original_no_grad
    assert torch.inference_mode is original_inference_mode


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("cache_enabled", "expect_grad"), [(True, False), (False, True)])
def test_torch_autocast_cache_behavior_with_no_grad(cache_enabled, expect_grad, dtype):
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_torch_autocast_cache_behavior_with_no_grad
    (float16 too, the CPU stand-in for ..._with_no_grad_cuda).

    Documents the torch behaviour our plugin works around by running autocast with ``cache_enabled=False``.
    """
    # PyTorch 2.11 fixed the bug where the autocast cache retained the `no_grad` state
    if cache_enabled and _TORCH_GREATER_EQUAL_2_11:
        expect_grad = True
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)

    with torch.autocast("cpu", dtype=dtype, cache_enabled=cache_enabled):
        with torch.no_grad():
            _ = layer(x)

        loss = layer(x).mean()
        if expect_grad:
            loss.backward()
            assert loss.grad_fn is not None
        else:
            assert loss.grad_fn is None
            with pytest.raises(RuntimeError, match="does not require grad"):
                loss.backward()


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_amp_autocast_context_manager_disables_cache(precision):
    """Port of tests/tests_pytorch/plugins/precision/test_amp.py::test_amp_autocast_context_manager_disables_cache."""
    amp = on_cpu(MixedPrecisionPlugin(precision=precision))

    with amp.autocast_context_manager():
        assert not torch.is_autocast_cache_enabled()


@pytest.mark.parametrize("policy", [None, CastPolicy(fp32_ops=["softmax"])], ids=["autocast", "with-op-overrides"])
@pytest.mark.parametrize(("precision", "dtype"), PRECISIONS)
def test_default_dtype_is_restored(precision, dtype, policy):
    """Port of tests/tests_pytorch/plugins/precision/test_all.py::test_default_dtype_is_restored.

    Adapted: Lightning's true-half plugins switch the default dtype inside their contexts; ours never does
    (autocast runs instead, plus the policy's op overrides when there are any). Either way an exception inside
    the context leaves the default dtype, autocast and the override mode as they were.
    """
    plugin = on_cpu(MixedPrecisionPlugin(precision, policy=policy))
    for context in (plugin.module_init_context, plugin.forward_context):
        assert torch.get_default_dtype() is torch.float32
        with pytest.raises(RuntimeError, match="foo"), context():
            if context == plugin.forward_context:
                assert torch.is_autocast_enabled("cpu")
                assert torch.get_autocast_dtype("cpu") == dtype
            assert torch.get_default_dtype() is torch.float32
            raise RuntimeError("foo")
        assert torch.get_default_dtype() is torch.float32
        assert not torch.is_autocast_enabled("cpu")
        # no override mode left behind: softmax runs in its input dtype again
        assert torch.softmax(torch.ones(2, dtype=dtype), 0).dtype == dtype


@pytest.mark.parametrize(("precision", "expected_dtype"), PRECISIONS)
def test_selected_dtype(precision, expected_dtype):
    """Port of tests/tests_pytorch/plugins/precision/test_half.py::test_selected_dtype (our plugin's dtype)."""
    plugin = MixedPrecisionPlugin(precision=precision, master_weights=True)
    assert plugin.precision == precision
    assert plugin.dtype == expected_dtype


@pytest.mark.parametrize(("precision", "expected_dtype"), PRECISIONS)
def test_convert_module(precision, expected_dtype):
    """Port of tests/tests_pytorch/plugins/precision/test_half.py::test_convert_module.

    With master weights, ``convert_module`` holds the model in half precision (normalisation layers stay fp32
    by default, which Lightning's true-half plugin does not do).
    """
    precision = MixedPrecisionPlugin(precision=precision, master_weights=True)
    module = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert module[0].weight.dtype == module[0].bias.dtype == torch.float32
    module = precision.convert_module(module)
    assert module[0].weight.dtype == module[0].bias.dtype == expected_dtype
    assert module[1].weight.dtype == torch.float32


@pytest.mark.parametrize(("precision", "expected_dtype"), PRECISIONS)
def test_configure_model(precision, expected_dtype):
    """Port of tests/tests_pytorch/plugins/precision/test_half.py::test_configure_model.

    Adapted: a layer created in ``configure_model`` is fp32 there (we convert after it, we do not change the
    default dtype), runs in half precision during ``test``, and the model has its fp32 values back afterwards
    (docs/master-weights.md: evaluation on its own gives the model back with its exact fp32 weights).
    """
    seen = []

    class MyModel(LightningModule):
        def configure_model(self):
            self.l = torch.nn.Linear(1, 3)
            assert self.l.weight.dtype == torch.float32

        def test_step(self, *_):
            seen.append(self.l.weight.dtype)

    model = MyModel()
    trainer = trainer_with(MixedPrecisionPlugin(precision, master_weights=True), barebones=True)
    trainer.test(model, [0])
    assert seen == [expected_dtype]
    assert model.l.weight.dtype == torch.float32


def test_fsdp_precision_default_scaler():
    """Port of tests/tests_pytorch/plugins/precision/test_fsdp.py::test_fsdp_precision_default_scaler.

    Adapted from FSDPPrecision's ShardedGradScaler: ``16-mixed`` gets a dynamic loss scaler by default.
    """
    precision = MixedPrecisionPlugin(precision="16-mixed")
    assert isinstance(precision.scaler, DynamicLossScaler)
    assert precision.scaler.enabled


def test_fsdp_precision_scaler_with_bf16():
    """Port of tests/tests_pytorch/plugins/precision/test_fsdp.py::test_fsdp_precision_scaler_with_bf16."""
    with pytest.raises(ValueError, match="precision='bf16-mixed' does not use loss scaling"):
        MixedPrecisionPlugin(precision="bf16-mixed", scaler=DynamicLossScaler())

    precision = MixedPrecisionPlugin(precision="bf16-mixed")
    # no loss scaling (a disabled scaler, if any, reports a scale of 1)
    assert precision.scaler is None or precision.scaler.scale == 1.0
