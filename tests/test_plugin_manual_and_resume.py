"""Manual optimization with two optimizers, and checkpoint resume."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from tests.helpers import TinyRegressor, make_trainer, params_of, regression_loader, seeded

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ACCELERATORS = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


class TwoOptimizers(L.LightningModule):
    """Manual optimization: one backward through both layers, then each layer's own optimizer steps."""

    def __init__(self, inject_inf_at=(), clip_val=None, lr=0.05):
        super().__init__()
        self.automatic_optimization = False
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)
        self.inject_inf_at = set(inject_inf_at)
        self.clip_val = clip_val
        self.lr = lr
        self.before = []  # parameters before each training_step

    def training_step(self, batch, batch_idx):
        self.before.append(params_of(self))
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.b(torch.tanh(self.a(x))).float(), y)
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        if batch_idx in self.inject_inf_at:
            self.a.weight.grad[0, 0] = float("inf")
        if self.clip_val is not None:
            self.clip_gradients(opt_a, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm")
            self.clip_gradients(opt_b, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm")
        opt_a.step()
        opt_b.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=self.lr), torch.optim.SGD(self.b.parameters(), lr=self.lr)


def _fp32_grads(params, batch):
    """Gradients of the loss at `params` in fp32, no plugin: the reference for one step."""
    with seeded():
        model = TwoOptimizers()
    model.load_state_dict(params)
    x, y = batch
    nn.functional.mse_loss(model.b(torch.tanh(model.a(x))), y).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_manual_two_optimizers_match_fp32(accelerator):
    results = {}
    for name, plugin in [("fp32", None), ("fp16", MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)))]:
        with seeded():
            model = TwoOptimizers()
        trainer = make_trainer(plugin, accelerator=accelerator)
        trainer.fit(model, regression_loader())
        results[name] = {k: v.cpu() for k, v in params_of(model).items()}
    assert trainer.scaler.steps == 16 and trainer.scaler.skipped_steps == 0
    for name in results["fp32"]:
        torch.testing.assert_close(results["fp16"][name], results["fp32"][name], rtol=0, atol=2e-3)


def test_manual_overflow_in_one_optimizer_skips_only_that_one_and_unscales_the_other_correctly():
    with seeded():
        model = TwoOptimizers(inject_inf_at=[2])
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    loader = regression_loader()
    make_trainer(plugin).fit(model, loader)
    after_step_2 = model.before[3]
    before_step_2 = model.before[2]
    for name in ("a.weight", "a.bias"):
        assert torch.equal(after_step_2[name], before_step_2[name])
    # opt_a's overflow halved the scale before opt_b unscaled: b must still get the fp32 update
    batch = list(loader)[2]
    grads = _fp32_grads(before_step_2, batch)
    for name in ("b.weight", "b.bias"):
        expected = before_step_2[name] - 0.05 * grads[name]
        torch.testing.assert_close(after_step_2[name], expected, rtol=0, atol=1e-4)
    assert plugin.scaler.scale == 512.0 and plugin.scaler.skipped_steps == 1


def test_manual_clip_gradients_inside_training_step_sees_unscaled_grads():
    with seeded():
        model = TwoOptimizers(clip_val=1e-3, lr=1.0)
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    make_trainer(plugin, max_steps=2).fit(model, regression_loader())
    start, end = model.before[0], params_of(model)
    for layer in ("a", "b"):
        delta = torch.stack([(start[f"{layer}.{p}"] - end[f"{layer}.{p}"]).norm() for p in ("weight", "bias")])
        assert torch.linalg.vector_norm(delta).item() == pytest.approx(1e-3, rel=1e-3)


# ---------------------------------------------------------------------- checkpoint resume
def _resume_settings():
    model_kwargs = dict(optimizer="adam", lr=1e-2, scheduler="step", gamma=0.95, inject_inf_at=[5, 13, 14])
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2)
    return model_kwargs, scaler


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_checkpoint_resume_reproduces_uninterrupted_run_bit_exactly(tmp_path, accelerator):
    model_kwargs, scaler = _resume_settings()
    with seeded(0):
        full = TinyRegressor(**model_kwargs)
    full_trainer = make_trainer(MixedPrecisionPlugin(scaler=scaler), accelerator=accelerator, max_epochs=4)
    full_trainer.fit(full, regression_loader())

    model_kwargs, scaler = _resume_settings()
    with seeded(0):
        first = TinyRegressor(**model_kwargs)
    first_trainer = make_trainer(MixedPrecisionPlugin(scaler=scaler), accelerator=accelerator, max_epochs=2)
    first_trainer.fit(first, regression_loader())
    path = tmp_path / "half.ckpt"
    first_trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["MixedPrecisionPlugin"]["scaler"] == first_trainer.scaler.state_dict()

    with seeded(1):  # different initial weights: everything must come from the checkpoint
        resumed = TinyRegressor(**model_kwargs)
    fresh_plugin = MixedPrecisionPlugin()  # default scaler settings: the checkpoint's must win
    resumed_trainer = make_trainer(fresh_plugin, accelerator=accelerator, max_epochs=4)
    resumed_trainer.fit(resumed, regression_loader(), ckpt_path=path)

    assert full_trainer.scaler.skipped_steps >= 2, "the run must exercise skips for the test to mean anything"
    assert resumed_trainer.scaler.state_dict() == full_trainer.scaler.state_dict()
    for name, param in full.named_parameters():
        assert torch.equal(resumed.get_parameter(name), param), name
    assert resumed_trainer.optimizers[0].param_groups[0]["lr"] == full_trainer.optimizers[0].param_groups[0]["lr"]
    full_state = full_trainer.optimizers[0].state_dict()["state"]
    resumed_state = resumed_trainer.optimizers[0].state_dict()["state"]
    for key in full_state:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed_state[key][field], full_state[key][field])


class SubclassedPlugin(MixedPrecisionPlugin):
    pass


def _checkpoint_after_two_epochs(tmp_path, plugin):
    with seeded():
        model = TinyRegressor(inject_inf_at=[3])
    trainer = make_trainer(plugin, max_epochs=2)
    trainer.fit(model, regression_loader())
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    return path, trainer


def test_resume_with_a_subclass_of_the_saving_plugin_keeps_the_scaler_state(tmp_path):
    path, saving = _checkpoint_after_two_epochs(
        tmp_path, MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    )
    resuming = SubclassedPlugin()
    with seeded():
        model = TinyRegressor()
    make_trainer(resuming, max_epochs=2).fit(model, regression_loader(), ckpt_path=path)  # restores, trains 0 steps
    assert resuming.scaler.state_dict() == saving.scaler.state_dict()
    assert resuming.scaler.scale == 512.0 and resuming.scaler.skipped_steps == 1


def test_resume_from_lightnings_builtin_mixed_precision_takes_its_scale(tmp_path):
    path, _ = _checkpoint_after_two_epochs(tmp_path, MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)))
    checkpoint = torch.load(path, weights_only=False)
    # what Lightning's MixedPrecision(16-mixed) saves: a torch.amp.GradScaler state under its class name
    del checkpoint["MixedPrecisionPlugin"]
    checkpoint["MixedPrecision"] = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=7).state_dict()
    torch.save(checkpoint, path)
    plugin = MixedPrecisionPlugin()
    with seeded():
        model = TinyRegressor()
    make_trainer(plugin, max_epochs=2).fit(model, regression_loader(), ckpt_path=path)
    assert plugin.scaler.scale == 256.0 and plugin.scaler.growth_interval == 7
