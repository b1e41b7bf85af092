"""No silent failures: each defect of issue 10 as a user met it, and the rule that fixes it."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import CastPolicy, DynamicLossScaler, MixedPrecisionPlugin
from lightning_mp.scaler import FP32_MAX
from tests.helpers import TinyRegressor, make_trainer, regression_loader, seeded


def _finite(module: nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


# ---------------------------------------------------------------------- 1, 2: stale unscale records
@pytest.mark.parametrize("masters", [False, True])
def test_none_step_with_clipping_does_not_leave_the_next_step_unchecked(masters):
    with seeded():
        model = TinyRegressor(return_none_at=[1], inject_inf_at=[2], record_grad_norms=False)
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0), master_weights=masters)
    trainer = make_trainer(plugin, max_steps=3, gradient_clip_val=0.5)
    trainer.fit(model, regression_loader())
    assert trainer.scaler.skipped_steps == 1
    assert _finite(model)


class ClipWithoutStep(L.LightningModule):
    """Manual optimization: clips every batch, steps only on odd batches (zero_grad after each step)."""

    def __init__(self, zero_grad_when_not_stepping: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(4, 1)
        self.zero_grad_when_not_stepping = zero_grad_when_not_stepping
        self.stepped_grad_max: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        self.clip_gradients(opt, gradient_clip_val=100.0, gradient_clip_algorithm="norm")
        if batch_idx % 2 == 1:
            self.stepped_grad_max.append(max(float(p.grad.abs().max()) for p in self.parameters()))
            opt.step()
            opt.zero_grad()
        elif self.zero_grad_when_not_stepping:
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("zero_grad", [False, True])
def test_manual_clip_on_a_batch_without_step_then_step_sees_true_gradients(zero_grad):
    runs = {}
    for name, plugin in (("fp32", None), ("fp16", MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)))):
        with seeded():
            model = ClipWithoutStep(zero_grad)
        make_trainer(plugin, max_epochs=1).fit(model, regression_loader())
        runs[name] = model
    reference, ours = runs["fp32"].stepped_grad_max, runs["fp16"].stepped_grad_max
    assert len(ours) == len(reference) == 4
    for mine, theirs in zip(ours, reference):
        assert mine == pytest.approx(theirs, rel=2e-2), (ours, reference)  # not 1024x
    assert _finite(runs["fp16"])


# ---------------------------------------------------------------------- 3, 6: the scaler's settings
@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(max_scale=1e300), "max_scale=1e+300"),
        (dict(init_scale=1e39, max_scale=1e39), "init_scale=1e+39"),
        (dict(growth_factor="2"), "growth_factor='2'"),
        (dict(backoff_factor="0.5"), "backoff_factor='0.5'"),
        (dict(enabled="no"), "enabled='no'"),
        (dict(hysteresis=2.0), "hysteresis=2.0"),
        (dict(max_consecutive_skips=0), "max_consecutive_skips=0"),
    ],
)
def test_bad_scaler_settings_are_refused_naming_value_and_what_is_allowed(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace("+", r"\+")) as err:
        DynamicLossScaler(**kwargs)
    assert "must be" in str(err.value)


def test_scale_never_grows_past_max_scale_even_at_the_largest_fp32():
    scaler = DynamicLossScaler(init_scale=1e38, growth_factor=2.0**4, growth_interval=1, max_scale=FP32_MAX)
    param = nn.Parameter(torch.ones(2))
    for _ in range(3):
        param.grad = scaler.scale_loss(torch.tensor(1.0)) * torch.ones(2)
        scaler.update(scaler.found_inf(scaler.unscale_([param])))
        assert scaler.scale == FP32_MAX and math.isfinite(scaler.scale)


# ---------------------------------------------------------------------- 4: scheduler frequency
class Scheduled(TinyRegressor):
    def __init__(self, frequency: int, **kwargs: Any) -> None:
        super().__init__(lr=0.01, **kwargs)
        self.frequency = frequency

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step", "frequency": self.frequency}}


@pytest.mark.parametrize(
    "skips, expected",
    [
        ((), [1, 0.5, 0.5, 0.25, 0.25, 0.125]),
        ((0,), [1, 1, 0.5, 0.5, 0.25, 0.25]),  # the skipped first step does not count
        ((1,), [1, 1, 0.5, 0.5, 0.25, 0.25]),  # nor the second, the last of its window
        ((0, 1), [1, 1, 1, 0.5, 0.5, 0.25]),
    ],
)
def test_scheduler_with_frequency_counts_only_optimizer_steps_that_ran(skips, expected):
    with seeded():
        model = Scheduled(frequency=2, inject_inf_at=list(skips), record_grad_norms=False)
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0, hysteresis=10))
    trainer = make_trainer(plugin, max_steps=6)
    trainer.fit(model, regression_loader())
    assert trainer.scaler.skipped_steps == len(skips)
    # the lr after each step, relative to the first: the skipped steps are not counted toward the frequency
    assert [lr / 0.01 for lr in model.lrs] == pytest.approx(expected)


# ---------------------------------------------------------------------- 5: corrupt checkpoints
@pytest.mark.parametrize(
    "key, value",
    [
        ("scale", -4.0),
        ("scale", float("nan")),
        ("backoff_factor", 2.0),
        ("growth_interval", 0),
        ("hysteresis_tracker", 7),
        ("enabled", "yes"),
        ("max_scale", 1e300),
        ("skipped_steps", -1),
    ],
)
def test_load_state_dict_refuses_corrupt_state_naming_key_value_and_source(key, value):
    state = DynamicLossScaler().state_dict()
    state[key] = value
    scaler = DynamicLossScaler(init_scale=8.0)
    with pytest.raises(ValueError) as err:
        scaler.load_state_dict(state, source="checkpoint['X']['scaler']")
    message = str(err.value)
    assert key in message and repr(value) in message and "checkpoint['X']['scaler']" in message
    assert scaler.scale == 8.0  # nothing was changed


def test_fit_refuses_a_hand_edited_checkpoint_before_training(tmp_path):
    with seeded():
        model = TinyRegressor(record_grad_norms=False)
    trainer = make_trainer(MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)), max_steps=2)
    trainer.fit(model, regression_loader())
    path = tmp_path / "edited.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["MixedPrecisionPlugin"]["scaler"]["backoff_factor"] = 2.0
    torch.save(checkpoint, path)
    trainer = make_trainer(MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)), max_steps=4)
    with pytest.raises(ValueError, match=r"checkpoint\['MixedPrecisionPlugin'\]\['scaler'\].*backoff_factor=2\.0"):
        trainer.fit(model, regression_loader(), ckpt_path=path)
    assert trainer.global_step == 0


# ---------------------------------------------------------------------- 6: policy input
def test_fp32_modules_must_be_strings():
    with pytest.raises(ValueError, match=r"fp32_modules=\[3\].*non-empty string"):
        CastPolicy(fp32_modules=[3])


def test_fp32_modules_rule_that_matches_nothing_warns_with_the_closest_names():
    with seeded():
        model = TinyRegressor(record_grad_norms=False)
    plugin = MixedPrecisionPlugin("bf16-mixed", policy={"fp32_modules": ["net.3", "Tanh"]})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(plugin, max_steps=1).fit(model, regression_loader())
    messages = [str(w.message) for w in caught if "matches no module" in str(w.message)]
    assert len(messages) == 1 and "'net.3'" in messages[0] and "net.2" in messages[0]


# ---------------------------------------------------------------------- 7: tied parameters with masters
class Tied(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4, bias=False)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight
        self.out = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.out(torch.tanh(self.head(torch.tanh(self.embed(x))))).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def test_tied_parameter_checkpoint_holds_the_fp32_master_under_every_name(tmp_path):
    with seeded():
        model = Tied()
    trainer = make_trainer(MixedPrecisionPlugin(master_weights=True), max_steps=4)
    trainer.fit(model, regression_loader())
    path = tmp_path / "tied.ckpt"
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert state["embed.weight"].dtype == state["head.weight"].dtype == torch.float32
    assert torch.equal(state["embed.weight"], state["head.weight"])
    assert torch.equal(state["embed.weight"], model.embed.weight)  # after fit the model holds the masters
    plain = Tied()
    plain.load_state_dict(state, strict=True)
    assert torch.equal(plain.head.weight, model.embed.weight)


def test_tied_parameter_resume_reproduces_the_uninterrupted_run_bit_exactly(tmp_path):
    with seeded():
        full = Tied()
    make_trainer(MixedPrecisionPlugin(master_weights=True), max_epochs=2).fit(full, regression_loader())
    with seeded():
        first = Tied()
    first_trainer = make_trainer(MixedPrecisionPlugin(master_weights=True), max_epochs=1)
    first_trainer.fit(first, regression_loader())
    first_trainer.save_checkpoint(tmp_path / "half.ckpt")
    with seeded(1):
        resumed = Tied()
    make_trainer(MixedPrecisionPlugin(master_weights=True), max_epochs=2).fit(
        resumed, regression_loader(), ckpt_path=tmp_path / "half.ckpt"
    )
    for name, param in full.named_parameters():
        assert torch.equal(resumed.get_parameter(name), param), name


def test_loading_a_state_dict_during_training_reaches_the_masters():
    from lightning_mp.master import MasterWeights

    model = Tied()
    masters = MasterWeights(torch.float16)
    masters.convert(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    masters.attach([optimizer])
    value = torch.full((4, 4), 1.0 + 2.0**-12)  # not representable in fp16
    state = {**{k: v.float() for k, v in model.state_dict().items()}, "embed.weight": value, "head.weight": value}
    model.load_state_dict(state, strict=True)
    assert torch.equal(masters.master_of(model.embed.weight), value)
    assert model.embed.weight.dtype == torch.float16 and torch.equal(model.embed.weight, value.half())


# ---------------------------------------------------------------------- 8: a static scale that skips forever
class AlwaysNaN(TinyRegressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(batch, batch_idx) * float("nan")


@pytest.mark.parametrize(
    "plugin, steps",
    [
        (lambda: MixedPrecisionPlugin(scaler=1024.0), 100),  # the default limit
        (lambda: MixedPrecisionPlugin(scaler=DynamicLossScaler.static(1024.0, max_consecutive_skips=7)), 7),
        (lambda: MixedPrecisionPlugin("bf16-mixed"), 100),
        (lambda: MixedPrecisionPlugin("bf16-mixed", scaler={"max_consecutive_skips": 5}), 5),
    ],
)
def test_steps_that_keep_being_skipped_fail_loudly_naming_the_parameters(plugin, steps):
    with seeded():
        model = AlwaysNaN(record_grad_norms=False)
    trainer = make_trainer(plugin(), max_steps=200, max_epochs=-1)
    with pytest.raises(FloatingPointError, match=rf"{steps} optimizer steps in a row.*net\.0\.weight"):
        trainer.fit(model, regression_loader())
    assert trainer.scaler.skipped_steps == steps
    assert _finite(model)


# ---------------------------------------------------------------------- 9: bf16 skips non-finite steps
def test_bf16_skips_a_nan_step_and_keeps_the_weights_finite():
    with seeded():
        model = TinyRegressor(inject_inf_at=[2], record_grad_norms=False)
    trainer = make_trainer(MixedPrecisionPlugin("bf16-mixed"), max_steps=5)
    trainer.fit(model, regression_loader())
    assert trainer.scaler.skipped_steps == 1 and trainer.scaler.scale == 1.0
    assert _finite(model)


def test_bf16_check_can_be_turned_off_and_then_nothing_is_skipped():
    with seeded():
        model = TinyRegressor(inject_inf_at=[2], record_grad_norms=False)
    plugin = MixedPrecisionPlugin("bf16-mixed", scaler={"enabled": False})
    trainer = make_trainer(plugin, max_steps=5)
    trainer.fit(model, regression_loader())
    assert not _finite(model)  # what the check prevents


def test_bf16_refuses_a_scaling_scaler():
    with pytest.raises(ValueError, match="bf16-mixed' does not use loss scaling"):
        MixedPrecisionPlugin("bf16-mixed", scaler=DynamicLossScaler())
    with pytest.raises(ValueError, match=r"\['init_scale'\] are not allowed with precision='bf16-mixed'"):
        MixedPrecisionPlugin("bf16-mixed", scaler={"init_scale": 8.0})


def test_scheduler_frequency_count_survives_a_resume(tmp_path):
    def run(epochs: int, ckpt_path: Any = None) -> L.Trainer:
        with seeded():
            model = Scheduled(frequency=3, inject_inf_at=[0], record_grad_norms=False)
        trainer = make_trainer(MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)), max_epochs=epochs)
        trainer.fit(model, regression_loader(), ckpt_path=ckpt_path)  # 8 steps an epoch
        return trainer

    full = run(2)
    first = run(1)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    assert first.lr_scheduler_configs[0].scheduler.state_dict()["_optimizer_steps_ran"] == 7  # step 0 skipped
    resumed = run(2, ckpt_path=tmp_path / "epoch1.ckpt")
    lr = [trainer.optimizers[0].param_groups[0]["lr"] for trainer in (full, resumed)]
    assert lr[0] == lr[1] == pytest.approx(0.01 * 0.5**5)  # 15 of 16 steps ran: five advances of frequency 3
