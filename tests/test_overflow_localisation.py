"""Overflow localisation: a skipped step is replayed to find the module, phase and operation where the inf/NaN was
born and why; the replay changes nothing about the run. fp16 on CPU, tiny tensors."""

import math

import pytest
import torch
from torch import nn

from lightning_mp import PrecisionMonitor
from lightning_mp.diagnostics.nonfinite import NonFiniteTrace
from tests.helpers import TinyRegressor
from tests.planted import Planted, PlantedModel, fit_planted


def _only(monitor):
    assert len(monitor.history.overflows) == 1, monitor.history.overflows
    return monitor.history.overflows[0]


def test_forward_overflow_planted_at_step_2_is_localised_to_its_module_in_forward_at_step_2():
    trainer, monitor = fit_planted(PlantedModel(Planted("forward", at=2)))
    record = _only(monitor)
    assert monitor.history.skipped == [2]
    assert (record.step, record.phase, record.module, record.module_class, record.op) == (
        2,
        "forward",
        "net.3",
        "Planted",
        "mul",
    )
    # the operation was fed finite values that fit fp16, and times 1e5 they do not
    assert 0 < record.input_amax <= 65504 < record.input_amax * 1e5
    assert record.cause == "half_precision"  # finite when replayed in fp32
    assert (record.scale_before, record.scale_after) == (1024.0, 512.0)
    assert record.nonfinite_params == ["net.0.weight", "net.0.bias", "net.4.weight", "net.4.bias"]
    assert record.seconds > 0 and record.replays == 2  # as trained, then fp32 (a forward origin needs no unscaled)


def test_overflow_in_a_backward_hook_is_localised_as_backward_in_the_hooked_module():
    trainer, monitor = fit_planted(PlantedModel(Planted("backward", at=1)))
    record = _only(monitor)
    assert (record.step, record.phase, record.module, record.op) == (1, "backward", "net.3", "mul")
    assert record.cause == "half_precision"  # 1e5 itself is inf in fp16, at any scale; fp32 is finite


def test_nan_from_log_of_a_negative_is_the_model_not_the_loss_scale():
    _, monitor = fit_planted(PlantedModel(Planted("log", at=2)))
    record = _only(monitor)
    where = (record.step, record.phase, record.module, record.op, record.cause)
    assert where == (2, "forward", "net.3", "log", "model")


def test_a_scale_too_large_for_the_gradients_is_the_loss_scale_not_the_model():
    # at 2**24 the scaled gradients overflow fp16 in backward; unscaled (scale 1) they are finite
    _, monitor = fit_planted(PlantedModel(), steps=1, init_scale=2.0**24)
    record = _only(monitor)
    assert (record.step, record.phase, record.cause) == (0, "backward", "loss_scale")
    assert record.replays == 2  # as trained, then unscaled
    assert record.scale_before == 2.0**24 and record.scale_after == 2.0**23


def test_replay_leaves_weights_optimizer_scaler_buffers_rng_and_logged_metrics_as_without_it():
    def run(localise):
        torch.manual_seed(0)
        model = PlantedModel(Planted("backward", at=1), dropout=0.5, batchnorm=True)  # the loss stays finite
        monitor = PrecisionMonitor(localise_overflows=localise, sample_every=0, report=False)
        trainer, _ = fit_planted(model, monitor=monitor, steps=4)
        return {
            "state": {k: v.clone() for k, v in model.state_dict().items()},  # weights and BatchNorm statistics
            "adam": [s["exp_avg"].clone() for s in trainer.optimizers[0].state.values()],
            "scaler": trainer.precision_plugin.scaler.state_dict(),
            "rng": torch.get_rng_state(),
            "logged": {k: repr(float(v)) for k, v in trainer.logged_metrics.items()},  # repr: nan == nan
            "records": len(monitor.history.overflows),
            "metric": (float(model.loss_mean.compute()), int(model.loss_mean._update_count)),
        }

    with_replay, without = run(True), run(False)
    assert with_replay["records"] == 1 and without["records"] == 0
    for key, value in without["state"].items():
        assert torch.equal(with_replay["state"][key], value), key
    assert all(torch.equal(a, b) for a, b in zip(with_replay["adam"], without["adam"]))
    assert with_replay["scaler"] == without["scaler"]
    assert torch.equal(with_replay["rng"], without["rng"])
    assert with_replay["logged"] == without["logged"] and "nan" not in str(without["logged"])
    assert with_replay["metric"] == without["metric"] and without["metric"][1] == 4


def test_dropout_is_replayed_with_the_masks_of_the_skipped_step():
    # with dropout 0.5 the overflow depends on which units survive: the replay must reproduce this step's masks
    _, monitor = fit_planted(PlantedModel(Planted("forward", at=2), dropout=0.5))
    record = _only(monitor)
    assert (record.phase, record.module, record.cause) == ("forward", "net.3", "half_precision")


def test_accumulation_with_master_weights_finds_the_micro_batch_that_overflowed():
    model = PlantedModel(Planted("forward", at=1, batch_idx=3))  # step 1 = batches 2 and 3; only 3 overflows
    _, monitor = fit_planted(model, steps=3, master_weights=True, accumulate_grad_batches=2)
    record = _only(monitor)
    assert (record.step, record.micro_batch, record.module, record.phase) == (1, 1, "net.3", "forward")
    assert record.cause == "half_precision"  # the fp32 replay swaps the fp32 masters into the half model
    assert record.nonfinite_params[0] == "net.0.weight"  # the masters' gradients, named as the model's parameters


def test_manual_optimization_records_the_parameters_with_nonfinite_gradients():
    _, monitor = fit_planted(PlantedModel(Planted("forward", at=2), manual=True))
    record = _only(monitor)
    assert (record.step, record.cause, record.phase) == (2, "gradients_only", "")
    assert record.nonfinite_params == ["net.0.weight", "net.0.bias", "net.4.weight", "net.4.bias"]


def test_inf_written_after_backward_is_not_reproduced_and_names_the_parameter():
    monitor = PrecisionMonitor(sample_every=0, report=False)
    from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
    from tests.helpers import make_trainer, regression_loader

    trainer = make_trainer(
        MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)), callbacks=[monitor], max_steps=3
    )
    trainer.fit(TinyRegressor(inject_inf_at=[1]), regression_loader())
    record = _only(monitor)
    assert (record.step, record.cause, record.nonfinite_params) == (1, "not_reproduced", ["net.0.weight"])
    assert record.replays == 1


def test_the_plugin_calls_its_skip_observers_on_skipped_steps_only_and_the_monitor_unregisters():
    from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
    from tests.helpers import make_trainer, regression_loader

    calls = []
    plugin = MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0))
    plugin.skip_observers.append(lambda **kwargs: calls.append((kwargs, plugin.scaler.scale)))
    make_trainer(plugin, max_steps=5).fit(PlantedModel(Planted("forward", at=3)), regression_loader())
    assert len(calls) == 1  # steps 0, 1, 2 and 4 were finite
    kwargs, scale = calls[0]
    assert set(kwargs) == {"plugin", "optimizer", "model"} and kwargs["plugin"] is plugin
    assert scale == 1024.0  # called before the scaler backs off
    assert isinstance(kwargs["optimizer"], torch.optim.Adam)

    trainer, _ = fit_planted(PlantedModel(Planted("forward", at=2)), steps=3)
    assert trainer.precision_plugin.skip_observers == []  # the monitor removed itself at teardown


def test_an_attention_mask_of_minus_inf_is_not_taken_for_the_origin():
    scores = torch.randn(2, 4, 4, dtype=torch.float16)
    mask = torch.ones(4, 4, dtype=torch.bool).triu(1)
    model = nn.Linear(4, 4).half()
    with NonFiniteTrace(model, torch.device("cpu")) as trace:
        attention = scores.masked_fill(mask, -math.inf).softmax(-1)  # -inf on purpose, finite after softmax
        out = model(attention) * 1e5  # the real overflow, outside any module
    assert not torch.isfinite(out).all()
    origin = trace.origin()
    assert (origin.op, origin.phase, origin.module_class) == ("mul", "forward", "(outside any module)")


def test_nonfinite_trace_credits_ops_to_the_innermost_module_in_forward_and_hook_code_in_backward():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3)))
    x = torch.full((2, 3), 10.0)
    with torch.no_grad():
        model[1][0].weight.fill_(1e38)  # fp32 overflow in the inner Linear's forward
    with NonFiniteTrace(model, torch.device("cpu")) as trace:
        model(x).sum()
    assert trace.origin() == trace.origin()  # reading twice is allowed
    origin = trace.origin()
    assert (origin.phase, origin.module, origin.module_class, origin.op) == ("forward", "1.0", "Linear", "addmm")

    with torch.no_grad():
        model[1][0].weight.fill_(1.0)
    with NonFiniteTrace(model, torch.device("cpu")) as trace:
        out = model(x)
        out.register_hook(lambda grad: grad * 1e39)  # backward code on the inner Linear's output
        trace.phase = "backward"
        torch.autograd.grad(out.sum(), list(model.parameters()))
    origin = trace.origin()
    assert (origin.phase, origin.module, origin.op) == ("backward", "1.0", "mul")
    assert origin.input_amax == 1.0  # the gradient of out.sum() that the hook multiplied


@pytest.mark.parametrize("bad", [{"sample_every": -1}, {"log_top": 1.5}, {"report": "yes"}])
def test_bad_monitor_arguments_name_the_value_and_what_is_allowed(bad):
    with pytest.raises(ValueError, match=f"PrecisionMonitor\\({next(iter(bad))}="):
        PrecisionMonitor(**bad)
