"""Ports of Lightning's AMP plugin tests to our plugin, on CPU (our fp16 autocast runs there for real).

Sources (github:Lightning-AI/pytorch-lightning): tests/tests_pytorch/plugins/test_amp_plugins.py and
tests/tests_pytorch/plugins/precision/test_amp_integration.py. Upstream runs most of them on CUDA only because
Lightning's ``16-mixed`` turns into bf16 on CPU. See tests/upstream/README.md for the full list.
"""

import re
from collections import Counter

import pytest
import torch
from lightning.fabric import seed_everything
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import Tensor

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from tests.upstream._helpers import MASTER_WEIGHTS, grads_of, on_cpu, pending_grads, trainer_with


class MyAMP(MixedPrecisionPlugin):
    pass


@pytest.mark.parametrize(("strategy", "devices"), [("ddp", 2), ("ddp_spawn", 2)])
@pytest.mark.parametrize("plugin_cls", [MixedPrecisionPlugin, MyAMP])
def test_amp_ddp(strategy, devices, plugin_cls):
    """Port of tests/tests_pytorch/plugins/test_amp_plugins.py::test_amp_ddp.

    Adapted: two CPU processes instead of two mocked GPUs (and no mocked SLURM environment); Lightning's own
    ``precision="16-mixed"`` case becomes our plugin itself, the custom case a subclass of it.
    """
    trainer = Trainer(
        fast_dev_run=True, accelerator="cpu", devices=devices, strategy=strategy, plugins=[plugin_cls("16-mixed")]
    )
    assert isinstance(trainer.precision_plugin, plugin_cls)


class ClippingOptimizer(torch.optim.SGD):
    def step(self, *args, pl_module=None):
        pl_module.check_grads_clipped()
        return super().step(*args)


class PrecisionModel(BoringModel):
    # sister test: test_lightning_manual_optimization.py::test_multiple_optimizers_step
    def on_after_backward(self) -> None:
        # check grads are scaled
        scale = self.trainer.scaler.scale
        assert scale != 1.0  # the return value if not enabled
        grads = pending_grads(self.trainer, self.parameters())
        inv_scale = 1 / scale
        self.original_grads = [p * inv_scale for p in grads]

    def check_grads_unscaled(self, optimizer=None):
        grads = grads_of(self.trainer, self.parameters())
        assert len(grads) == len(self.original_grads)
        for actual, expected in zip(grads, self.original_grads):
            torch.testing.assert_close(actual, expected, equal_nan=True)

    def check_grads_clipped(self):
        grads = grads_of(self.trainer, self.parameters())
        assert len(grads) == len(self.clipped_parameters)
        for actual, expected in zip(grads, self.clipped_parameters):
            torch.testing.assert_close(actual, expected.grad, equal_nan=True)

    def on_before_optimizer_step(self, optimizer, *_):
        self.check_grads_unscaled(optimizer)
        # manually clip
        self.clipped_parameters = []
        for p, grad in zip(self.parameters(), grads_of(self.trainer, self.parameters())):
            copy = p.detach().float().clone()
            copy.grad = grad.clone()
            self.clipped_parameters.append(copy)
        clip_val = self.trainer.gradient_clip_val
        torch.nn.utils.clip_grad_value_(self.clipped_parameters, clip_val)

    def configure_gradient_clipping(self, *args, **kwargs):
        # let lightning clip
        super().configure_gradient_clipping(*args, **kwargs)
        # check clipping worked as expected
        self.check_grads_clipped()

    def optimizer_step(self, epoch, batch_idx, optimizer, closure, **_):
        # pass self as a kwarg
        optimizer.step(closure, pl_module=self)

    def configure_optimizers(self):
        return ClippingOptimizer(self.layer.parameters(), lr=0.1)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
@pytest.mark.parametrize("accum", [1, 2])
def test_amp_gradient_unscale(tmp_path, accum: int, master_weights):
    """Port of tests/tests_pytorch/plugins/test_amp_plugins.py::test_amp_gradient_unscale.

    Hooks see the gradients of ``on_after_backward`` divided by the scale, clipping by value clips those, and
    the optimizer's ``step`` (which receives the extra keyword) sees the clipped ones. Adapted: one CPU device
    instead of two GPUs under ddp_spawn; torch's per-optimizer "UNSCALED" stage (a GradScaler internal) is not
    asserted; with master weights the gradients are read on the fp32 masters.
    """
    model = PrecisionModel()

    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", master_weights=master_weights),
        max_epochs=2,
        default_root_dir=tmp_path,
        limit_train_batches=2,
        limit_val_batches=0,
        # use a tiny value to make sure it works
        gradient_clip_val=1e-3,
        gradient_clip_algorithm="value",
        log_every_n_steps=1,
        accumulate_grad_batches=accum,
    )
    trainer.fit(model)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
def test_amp_skip_optimizer(tmp_path, master_weights):
    """Port of tests/tests_pytorch/plugins/test_amp_plugins.py::test_amp_skip_optimizer.

    Optimizers can be skipped when using amp. Adapted: CPU instead of one GPU; we also check that the one
    ``opt2.step()`` is the scaler's one step.
    """

    class CustomBoringModel(BoringModel):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.layer1 = torch.nn.Linear(32, 32)
            self.layer2 = torch.nn.Linear(32, 2)

        def forward(self, x: Tensor):
            x = self.layer1(x)
            return self.layer2(x)

        def training_step(self, batch, batch_idx):
            _, opt2 = self.optimizers()
            output = self(batch)
            loss = self.loss(output)
            opt2.zero_grad()
            self.manual_backward(loss)
            # only optimizer 2 steps
            opt2.step()

        def configure_optimizers(self):
            return [
                torch.optim.SGD(self.layer1.parameters(), lr=0.1),
                torch.optim.SGD(self.layer2.parameters(), lr=0.1),
            ]

    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", master_weights=master_weights), default_root_dir=tmp_path, fast_dev_run=1
    )
    model = CustomBoringModel()
    trainer.fit(model)
    assert trainer.scaler.steps == 1


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_cpu_amp_precision_context_manager(precision, dtype):
    """Port of tests/tests_pytorch/plugins/test_amp_plugins.py::test_cpu_amp_precision_context_manager.

    The context manager is set to CPU and the precision's dtype. Adapted: our fp16 stays fp16 on CPU
    (Lightning's switches to bf16), and only fp16 has a loss scale.
    """
    plugin = on_cpu(MixedPrecisionPlugin(precision))
    assert plugin.device_type == "cpu"
    if precision == "bf16-mixed":
        assert plugin.scaler is None or plugin.scaler.scale == 1.0
    else:
        assert isinstance(plugin.scaler, DynamicLossScaler) and plugin.scaler.scale > 1.0
    context_manager = plugin.autocast_context_manager()
    assert isinstance(context_manager, torch.autocast)
    assert context_manager.fast_dtype == dtype


def test_amp_precision_plugin_parameter_validation():
    """Port of tests/tests_pytorch/plugins/test_amp_plugins.py::test_amp_precision_plugin_parameter_validation."""
    MixedPrecisionPlugin("16-mixed")  # should not raise exception
    MixedPrecisionPlugin("bf16-mixed")

    allowed = re.escape("use one of ['16-mixed', 'bf16-mixed']")
    with pytest.raises(ValueError, match=re.escape("MixedPrecisionPlugin(precision='16')") + ".*" + allowed):
        MixedPrecisionPlugin("16")

    with pytest.raises(ValueError, match=re.escape("MixedPrecisionPlugin(precision=16)") + ".*" + allowed):
        MixedPrecisionPlugin(16)

    with pytest.raises(ValueError, match=re.escape("MixedPrecisionPlugin(precision='bf16')") + ".*" + allowed):
        MixedPrecisionPlugin("bf16")


class FusedOptimizerParityModel(BoringModel):
    def __init__(self, fused=False):
        super().__init__()
        self.fused = fused

    def configure_optimizers(self):
        assert isinstance(self.trainer.precision_plugin.scaler, DynamicLossScaler)
        return torch.optim.Adam(self.parameters(), lr=1.0, fused=self.fused)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
def test_amp_fused_optimizer_parity(tmp_path, master_weights):
    """Port of tests/tests_pytorch/plugins/precision/test_amp_integration.py::test_amp_fused_optimizer_parity.

    Both the regular and the fused version of Adam produce the same model weights. Adapted: CPU instead of
    CUDA (fused Adam exists on CPU in torch 2.13).
    """

    def run(fused=False):
        seed_everything(1234)
        model = FusedOptimizerParityModel(fused)
        trainer = trainer_with(
            MixedPrecisionPlugin("16-mixed", master_weights=master_weights), default_root_dir=tmp_path, max_steps=5
        )
        trainer.fit(model)
        return list(model.parameters())

    params = run(fused=False)
    params_fused = run(fused=True)

    for p, q in zip(params, params_fused):
        torch.testing.assert_close(p, q)


class _CountingScaler(DynamicLossScaler):
    """Counts the calls the plugin makes (upstream wraps torch's GradScaler in a Mock)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = Counter()

    def unscale_(self, params):
        params = list(params)
        self.calls["unscale_"] += 1
        if any(getattr(p, "grad", None) is not None for p in (q[1] if isinstance(q, tuple) else q for q in params)):
            self.calls["unscale_ with gradients"] += 1
        return super().unscale_(params)

    def update(self, found_inf):
        self.calls["update"] += 1
        return super().update(found_inf)


class _CountingSGD(torch.optim.SGD):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_calls = 0

    def step(self, *args, **kwargs):
        self.step_calls += 1
        return super().step(*args, **kwargs)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
def test_skip_training_step_with_grad_scaler(master_weights):
    """Port of tests/tests_pytorch/plugins/precision/test_amp_integration.py::test_skip_training_step_with_grad_scaler.

    The grad scaler gets skipped when skipping a training step (``training_step`` returns None), with
    gradient clipping on. Adapted: CPU instead of CUDA; our scaler has no ``step``: the 3 scaler steps are the
    3 ``update`` calls, each of which either stepped the optimizer or reported a skipped step. Added: the 3
    ``unscale_`` calls are the 3 real steps' (they find gradients), and the weights stay finite (the fp16 run
    overflows at first: those steps must be skipped, not applied).
    """

    class TestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None  # skipping the backward should skip the grad scaler too
            return super().training_step(batch, batch_idx)

        def configure_optimizers(self):
            return _CountingSGD(self.parameters(), lr=0.1)

    scaler = _CountingScaler()
    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", scaler=scaler, master_weights=master_weights),
        barebones=True,
        max_steps=5,
        gradient_clip_val=0.5,
    )
    assert trainer.scaler is scaler
    model = TestModel()
    trainer.fit(model)
    assert scaler.calls["unscale_"] == 3
    assert scaler.calls["unscale_ with gradients"] == 3
    assert trainer.optimizers[0].step_calls + scaler.skipped_steps == 3
    assert scaler.calls["update"] == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
