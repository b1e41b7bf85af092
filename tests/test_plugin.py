"""MixedPrecisionPlugin inside a real Lightning Trainer, with a tiny model (fp16 on CPU is real fp16)."""

import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from tests.helpers import (
    HostSyncCounter,
    MatmulDtypes,
    TinyRegressor,
    make_trainer,
    params_of,
    regression_loader,
    seeded,
)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# (accelerator, precision): CPU runs fp16 for real (tiny model), CUDA runs both when a GPU is present
DEVICE_PRECISIONS = [
    pytest.param("cpu", "16-mixed", id="cpu-fp16"),
    pytest.param("cuda", "16-mixed", id="cuda-fp16", marks=[pytest.mark.gpu, CUDA]),
]


class WeightRecorder(L.Callback):
    """Parameters before and after every training batch."""

    def __init__(self):
        self.before, self.after = [], []

    def on_train_batch_start(self, trainer, pl_module, *args):
        self.before.append(params_of(pl_module))

    def on_train_batch_end(self, trainer, pl_module, *args):
        self.after.append(params_of(pl_module))


def _fit(model, plugin, accelerator="cpu", callbacks=(), **trainer_kwargs):
    trainer = make_trainer(plugin, accelerator=accelerator, callbacks=list(callbacks), **trainer_kwargs)
    trainer.fit(model, regression_loader())
    return trainer


def _changed(before, after):
    return any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("accelerator, precision", DEVICE_PRECISIONS)
def test_injected_inf_skips_step_halves_scale_and_holds_step_scheduler(accelerator, precision):
    recorder = WeightRecorder()
    with seeded():
        model = TinyRegressor(scheduler="step", inject_inf_at=[3])
    plugin = MixedPrecisionPlugin(precision, scaler=DynamicLossScaler(init_scale=1024.0))
    trainer = _fit(model, plugin, accelerator, callbacks=[recorder])

    assert trainer.scaler is plugin.scaler
    assert plugin.scaler.skipped_steps == 1 and plugin.scaler.scale == 512.0
    steps = len(recorder.before)
    for i in range(steps):
        assert _changed(recorder.before[i], recorder.after[i]) == (i != 3), f"batch {i}"
    # StepLR(step_size=1, gamma=0.5) advanced on every step except the skipped one
    expected = [0.05 * 0.5 ** (i + 1 - (i >= 3)) for i in range(steps)]
    assert model.lrs == pytest.approx(expected, rel=1e-12)


def test_epoch_scheduler_still_steps_after_a_skipped_last_step():
    with seeded():
        model = TinyRegressor(scheduler="epoch", inject_inf_at=[7])  # the last of 8 batches overflows
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    trainer = _fit(model, plugin, max_epochs=2)
    assert plugin.scaler.skipped_steps == 1
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)


def test_step_scheduler_keeps_its_class_state_dict_and_pickles():
    with seeded():
        model = TinyRegressor(scheduler="step")
    trainer = _fit(model, MixedPrecisionPlugin(precision="bf16-mixed"))
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert set(scheduler.state_dict()) == set(
        torch.optim.lr_scheduler.StepLR(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), 1).state_dict()
    )
    import pickle

    assert type(pickle.loads(pickle.dumps(scheduler))) is torch.optim.lr_scheduler.StepLR


def test_overflow_at_min_scale_raises_naming_the_parameter():
    with seeded():
        model = TinyRegressor(inject_inf_at=[2], inject_param="net.2.weight")
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1.0, min_scale=1.0))
    with pytest.raises(FloatingPointError, match=r"net\.2\.weight") as err:
        _fit(model, plugin)
    assert "net.0.weight" not in str(err.value)


def _reference_fp32(model_kwargs, **trainer_kwargs):
    with seeded():
        model = TinyRegressor(**model_kwargs)
    _fit(model, None, **trainer_kwargs)
    return model


@pytest.mark.parametrize("accelerator, precision", DEVICE_PRECISIONS)
def test_hooks_see_unscaled_gradients(accelerator, precision):
    with seeded():
        model = TinyRegressor()
    plugin = MixedPrecisionPlugin(precision, scaler=DynamicLossScaler(init_scale=2.0**10))
    _fit(model, plugin, accelerator, max_steps=3)
    reference = _reference_fp32({}, max_steps=3)
    assert plugin.scaler.skipped_steps == 0
    # the scale is 1024: scaled grads would be 3 orders of magnitude larger
    assert model.grad_norms_seen == pytest.approx(reference.grad_norms_seen, rel=2e-2)


@pytest.mark.parametrize("accelerator, precision", DEVICE_PRECISIONS)
@pytest.mark.parametrize("algorithm, clip_val", [("norm", 1e-3), ("value", 1e-4)])
def test_clipping_acts_on_unscaled_gradients(accelerator, precision, algorithm, clip_val):
    recorder = WeightRecorder()
    with seeded():
        model = TinyRegressor(lr=1.0)
    _fit(
        model,
        MixedPrecisionPlugin(precision, scaler=DynamicLossScaler(init_scale=2.0**10)),
        accelerator,
        callbacks=[recorder],
        max_steps=2,
        gradient_clip_val=clip_val,
        gradient_clip_algorithm=algorithm,
    )
    # SGD with lr=1: the update is minus the clipped gradient; clipping scaled grads would make it 1024x smaller
    deltas = [recorder.before[0][k] - recorder.after[0][k] for k in recorder.before[0]]
    if algorithm == "norm":
        total = torch.linalg.vector_norm(torch.stack([d.norm() for d in deltas]))
        assert total.item() == pytest.approx(clip_val, rel=1e-3)
    else:
        largest = max(d.abs().max().item() for d in deltas)
        assert largest == pytest.approx(clip_val, rel=1e-3)


def test_gradient_accumulation_matches_fp32_and_updates_scaler_per_optimizer_step():
    with seeded():
        model = TinyRegressor(optimizer="adam", lr=1e-2)
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=256.0, growth_interval=2))
    _fit(model, plugin, accumulate_grad_batches=4)
    reference = _reference_fp32(dict(optimizer="adam", lr=1e-2), accumulate_grad_batches=4)
    assert plugin.scaler.steps == 2  # 8 batches / 4
    assert plugin.scaler.scale == 512.0  # grew once after 2 finite optimizer steps
    for name, param in reference.named_parameters():
        # fp16 forward/backward: ~1e-3 relative error in grads; Adam normalises it away to ~lr * 1e-3
        torch.testing.assert_close(model.get_parameter(name), param, rtol=0, atol=2e-4)


def test_training_step_returning_none_skips_without_error():
    recorder = WeightRecorder()
    with seeded():
        model = TinyRegressor(return_none_at=[1, 4])
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    _fit(model, plugin, callbacks=[recorder])
    changed = [_changed(b, a) for b, a in zip(recorder.before, recorder.after)]
    assert changed == [i not in (1, 4) for i in range(8)]
    assert plugin.scaler.steps == 6 and plugin.scaler.skipped_steps == 0


def test_lbfgs_is_refused_with_a_clear_error():
    with seeded():
        model = TinyRegressor(optimizer="lbfgs")
    with pytest.raises(MisconfigurationException, match="LBFGS"):
        _fit(model, MixedPrecisionPlugin())


def test_fused_adam_with_clipping_matches_unfused():
    results = []
    for fused in (False, True):
        with seeded():
            model = TinyRegressor(optimizer="adam", lr=1e-2, fused=fused)
        _fit(model, MixedPrecisionPlugin(), max_steps=4, gradient_clip_val=0.1)
        results.append(params_of(model))
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-5, atol=1e-6)


def test_fp16_on_cpu_really_runs_fp16_matmuls():
    plugin = MixedPrecisionPlugin("16-mixed")
    model = TinyRegressor()
    plugin.connect(model, [], [])
    with MatmulDtypes() as seen, plugin.forward_context():
        out = model(torch.randn(3, 4))
    assert out.dtype == torch.float16
    assert seen.dtypes == {torch.float16}


def test_bf16_plugin_checks_without_scaling_and_runs_bf16():
    plugin = MixedPrecisionPlugin("bf16-mixed")
    assert plugin.scaler is not None and plugin.scaler.check_only and plugin.scaler.scale == 1.0
    loss = torch.tensor(3.0)
    assert plugin.scaler.scale_loss(loss) is loss  # no scaling, only the inf/NaN check
    with seeded():
        model = TinyRegressor()
    with MatmulDtypes() as seen:
        trainer = _fit(model, plugin, max_steps=2)
    assert trainer.scaler is plugin.scaler and trainer.scaler.skipped_steps == 0
    assert torch.bfloat16 in seen.dtypes and torch.float16 not in seen.dtypes


def test_fp16_on_cpu_warns_once(monkeypatch):
    import lightning_mp.forward

    monkeypatch.setattr(lightning_mp.forward, "_WARNED_FP16_ON_CPU", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with seeded():
                _fit(TinyRegressor(), MixedPrecisionPlugin(), max_steps=1)
    messages = [str(w.message) for w in caught if "fp16 autocast on CPU" in str(w.message)]
    assert len(messages) == 1 and "bf16-mixed" in messages[0]


def test_model_summary_and_example_input_work():
    with seeded():
        model = TinyRegressor()
    trainer = _fit(model, MixedPrecisionPlugin("bf16-mixed"), max_steps=1, enable_model_summary=True)
    summary = L.pytorch.utilities.model_summary.ModelSummary(model)
    assert summary.total_parameters == sum(p.numel() for p in model.parameters())
    assert trainer.precision == "bf16-mixed"


def test_one_host_sync_per_optimizer_step(monkeypatch):
    counts = []
    original = MixedPrecisionPlugin.optimizer_step

    def counted(self, optimizer, model, closure, **kwargs):
        with HostSyncCounter() as counter:
            result = original(self, optimizer, model, _uncounted(closure), **kwargs)
        counts.append(len(counter.calls))
        return result

    monkeypatch.setattr(MixedPrecisionPlugin, "optimizer_step", counted)
    with seeded():
        # SGD and no gradient-norm probe: Adam on CPU and the probe call .item() themselves
        model = TinyRegressor(optimizer="sgd", record_grad_norms=False)
    _fit(model, MixedPrecisionPlugin(), max_steps=4, gradient_clip_val=1.0)
    assert counts == [1, 1, 1, 1]


def _uncounted(closure):
    """Run the closure (forward, backward, Lightning's hooks) outside the sync counter."""
    from torch.overrides import _pop_mode_temporarily

    def run():
        with _pop_mode_temporarily():
            return closure()

    return run


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(precision="16"), "precision='16'"),
        (dict(precision="fp16"), "precision='fp16'"),
        (dict(precision="32-true"), "precision='32-true'"),
        (dict(scaler=0.0), "scale=0.0"),
        (dict(scaler=-128.0), "scale=-128.0"),
        (dict(scaler="dynamic"), "scaler='dynamic'"),
        (dict(precision="bf16-mixed", scaler=DynamicLossScaler()), "bf16-mixed"),
        (dict(precision="bf16-mixed", scaler=1024.0), "bf16-mixed"),
    ],
)
def test_bad_input_raises_value_error_at_construction(kwargs, fragment):
    with pytest.raises(ValueError) as err:
        MixedPrecisionPlugin(**kwargs)
    assert fragment in str(err.value)


def test_bf16_accepts_a_disabled_scaler():
    plugin = MixedPrecisionPlugin("bf16-mixed", scaler=DynamicLossScaler(enabled=False))
    assert plugin.scaler is not None and not plugin.scaler.enabled


def test_static_scale_from_a_number():
    with seeded():
        model = TinyRegressor(inject_inf_at=[2])
    plugin = MixedPrecisionPlugin(scaler=512.0)
    _fit(model, plugin)
    assert plugin.scaler.scale == 512.0 and plugin.scaler.skipped_steps == 1 and not plugin.scaler.dynamic


ALL_DEVICE_PRECISIONS = [
    pytest.param("cpu", "16-mixed", id="cpu-fp16"),
    pytest.param("cpu", "bf16-mixed", id="cpu-bf16"),
    pytest.param("cuda", "16-mixed", id="cuda-fp16", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda", "bf16-mixed", id="cuda-bf16", marks=[pytest.mark.gpu, CUDA]),
]


@pytest.mark.parametrize("accelerator, precision", ALL_DEVICE_PRECISIONS)
def test_trains_like_fp32_with_autocast_on_the_models_device(accelerator, precision):
    with seeded():
        model = TinyRegressor(optimizer="adam", lr=1e-2)
    scaler = DynamicLossScaler(init_scale=1024.0) if precision == "16-mixed" else None
    plugin = MixedPrecisionPlugin(precision, scaler=scaler)
    _fit(model, plugin, accelerator, max_epochs=2)
    reference = _reference_fp32(dict(optimizer="adam", lr=1e-2), max_epochs=2)
    assert plugin.device_type == accelerator
    # Adam divides out the gradient's magnitude, so each step's update is off by about lr times the gradient's
    # relative error: a few roundings of 2**-11 (fp16) or 2**-8 (bf16), ~1e-3 and ~8e-3. Over 16 steps at
    # lr=1e-2 that adds up to at most ~1.6e-4 and ~1.3e-3; the bounds leave a 2x margin
    atol = 4e-4 if precision == "16-mixed" else 2.5e-3
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).cpu(), param, rtol=0, atol=atol)
