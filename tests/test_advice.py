"""Advice rules: each fires on a constructed run that shows its symptom, quotes the evidence, and stays quiet on a
clean run."""

import pytest

from lightning_mp.diagnostics import Advice, LayerSample, OverflowRecord, RunHistory, advise

_SCALER = {
    "scale": 65536.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    "hysteresis": 1,
    "min_scale": 1.0,
    "max_scale": 2.0**24,
    "dynamic": True,
    "check_only": False,
    "max_consecutive_skips": 100,
}
_LAYERS = ["embed", "encoder.0.ffn", "encoder.1.ffn", "head"]


def _sample(step, scale=65536.0, underflow=(0.001, 0.0, 0.0, 0.0), amax=(16384.0, 8192.0, 4096.0, 2048.0)):
    """Rows of 10,000 values each: ``underflow`` shares split evenly between flush and subnormal."""
    rows = [[10000.0, 10.0, 5000.0 * u, 5000.0 * u, 0.0, a] for u, a in zip(underflow, amax)]
    return LayerSample(step=step, scale=scale, kind="param_grads", layers=list(_LAYERS), rows=rows)


def _history(skipped=(), records=(), samples=None, steps=400, scale_changes=None, error="", **scaler):
    scale_changes = scale_changes or [(0, 65536.0)]
    samples = samples if samples is not None else [_sample(step) for step in range(0, steps, 50)]
    return RunHistory(
        precision="fp16",
        scaler={**_SCALER, **scaler},
        steps=steps,
        scale_changes=scale_changes,
        skipped=list(skipped),
        overflows=list(records),
        samples=samples,
        sample_every=50,
        error=error,
    )


def _record(step, module="encoder.1.ffn", cause="half_precision", phase="forward", scale=65536.0):
    return OverflowRecord(
        step=step,
        scale_before=scale,
        scale_after=scale / 2,
        cause=cause,
        phase=phase,
        module=module,
        module_class="Linear",
        op="addmm",
        input_amax=310.0,
    )


def _rules(history):
    return {advice.rule: advice for advice in advise(history)}


def test_a_clean_run_gets_no_advice():
    assert advise(_history()) == []


def test_skips_right_after_the_scale_grew_are_probing_and_get_no_advice():
    # every 100 steps the scale doubles and the next step overflows: healthy dynamic scaling
    changes, skipped, records = [(0, 1024.0)], [], []
    for grown in range(100, 400, 100):
        changes += [(grown, 2048.0), (grown + 2, 1024.0)]
        skipped.append(grown + 1)
        records.append(_record(grown + 1, cause="loss_scale", phase="backward", scale=2048.0))
    assert advise(_history(skipped, records, scale_changes=changes, growth_interval=100)) == []


def test_fp32_modules_rule_names_the_module_that_overflowed_half_precision_in_most_skips():
    skipped = [60, 130, 210, 290, 370]
    records = [_record(s) for s in skipped[:4]] + [_record(370, module="head", cause="loss_scale", phase="backward")]
    advice = _rules(_history(skipped, records))["fp32_modules"]
    assert 'fp32_modules: ["encoder.1.ffn"]' in advice.change
    assert "4 of 5 skipped steps" in advice.evidence and "60, 130, 210, 290" in advice.evidence
    # the same skips caused by the loss scale (finite unscaled) are the scaler's business, not fp32_modules'
    scaled = [_record(s, cause="loss_scale", phase="backward") for s in skipped]
    assert "fp32_modules" not in _rules(_history(skipped, scaled))


def test_init_scale_rule_fires_when_the_first_steps_are_skipped_while_the_scale_comes_down():
    skipped = list(range(8))
    changes = [(step, 65536.0 / 2**step) for step in range(9)]
    advice = _rules(_history(skipped, scale_changes=changes))["init_scale"]
    assert advice.change == "scaler: {init_scale: 256}"
    assert "8 of the first 50" in advice.evidence and "from 2^16 to 2^8" in advice.evidence
    assert "step 8 was the first to run" in advice.evidence
    # the same early skips from a module that overflows fp16 at any scale are not the init_scale's doing
    records = [_record(step, scale=65536.0 / 2**step) for step in skipped]
    assert "init_scale" not in _rules(_history(skipped, records, scale_changes=changes))


def test_hysteresis_rule_fires_on_isolated_bursts_that_are_not_probing():
    skipped = [120, 121, 400, 700, 1000]
    records = [_record(s, cause="loss_scale", phase="backward") for s in skipped]
    changes = [(0, 65536.0), (121, 32768.0), (122, 16384.0), (401, 8192.0), (701, 4096.0), (1001, 2048.0)]
    advice = _rules(_history(skipped, records, scale_changes=changes, steps=1200))["hysteresis"]
    assert advice.change == "scaler: {hysteresis: 3}"
    assert "4 isolated bursts of at most 2" in advice.evidence and "120, 400, 700, 1000" in advice.evidence
    # already tolerant enough: no advice
    assert "hysteresis" not in _rules(_history(skipped, records, scale_changes=changes, steps=1200, hysteresis=3))


def test_growth_interval_rule_fires_on_underflow_with_ample_headroom():
    starving = [
        _sample(step, scale=256.0, underflow=(0.002, 0.05, 0.0, 0.0), amax=(1024.0, 512.0, 256.0, 128.0))
        for step in range(0, 400, 50)
    ]
    advice = _rules(_history(samples=starving))["growth_interval"]
    assert advice.change == "scaler: {growth_interval: 500}"
    assert "encoder.0.ffn, 5.0%" in advice.evidence and "6.0 powers of two below 65504" in advice.evidence
    # the same underflow without headroom (the largest gradient is near 65504) is not a low scale
    crowded = [_sample(step, underflow=(0.002, 0.05, 0.0, 0.0)) for step in range(0, 400, 50)]
    assert "growth_interval" not in _rules(_history(samples=crowded))


def test_growth_interval_rule_suggests_a_larger_static_scale_for_a_static_scaler():
    starving = [
        _sample(step, scale=256.0, underflow=(0.0, 0.05, 0.0, 0.0), amax=(1024.0, 512.0, 256.0, 128.0))
        for step in range(0, 400, 50)
    ]
    advice = _rules(_history(samples=starving, dynamic=False))["growth_interval"]
    # largest 1024 * 16 = 16384: one to two powers of two of margin left below 65504
    assert advice.change == "a static scale of 4096 (now 256)"


@pytest.mark.parametrize("symptom", ["skip_rate", "half_overflows", "min_scale"])
def test_bf16_rule_fires_when_fp16_keeps_fighting(symptom):
    if symptom == "skip_rate":
        history = _history(skipped=list(range(60, 400, 30)), steps=400)  # 12 of 350 later steps: 3.4%
        expected = "12 of 350 optimizer steps after the first 50 were skipped (3.4%)"
    elif symptom == "half_overflows":
        history = _history(skipped=[70, 90, 300], records=[_record(70), _record(90, "head"), _record(300, "embed")])
        expected = "3 skipped steps overflowed half precision even without the loss scale"
    else:
        history = _history(error="FloatingPointError: Loss scale 1 cannot back off below min_scale=1")
        expected = "the run ended with FloatingPointError: Loss scale 1 cannot back off below min_scale=1"
    advice = _rules(history)["bf16"]
    assert advice.change.startswith("trainer.precision: bf16-mixed") and expected in advice.evidence


def test_model_rule_fires_when_the_inf_nan_survives_fp32_and_bf16_runs_get_no_fp16_advice():
    record = _record(200, module="head", cause="model")
    advice = _rules(_history([200], [record]))["model"]
    assert "head (Linear), forward, op addmm" in advice.evidence and "largest finite input 310" in advice.evidence
    bf16 = _history([200], [record])
    bf16.precision = "bf16"
    assert set(_rules(bf16)) == {"model"}


def test_every_rule_is_advice_with_a_change_and_evidence():
    history = _history(list(range(8)), scale_changes=[(s, 65536.0 / 2**s) for s in range(9)])
    for advice in advise(history):
        assert isinstance(advice, Advice) and advice.change and advice.evidence


def _outside(step, cause):
    return OverflowRecord(
        step=step,
        scale_before=65536.0,
        scale_after=32768.0,
        cause=cause,
        phase="forward",
        module="",
        module_class="(outside any module)",
        op="mul",
        input_amax=3e4,
    )


def test_an_origin_in_training_step_gets_no_fp32_modules_rule_but_the_op_to_compute_in_fp32_there():
    skipped = [60, 130, 210]
    rules = _rules(_history(skipped, [_outside(s, "half_precision") for s in skipped]))
    assert "fp32_modules" not in rules  # no module rule reaches code outside a submodule
    advice = rules["fp32_code"]
    assert advice.change.startswith("compute mul in training_step in float32")
    assert "training_step (outside any module) was where the inf/NaN was born in 3 of 3" in advice.evidence


def test_model_advice_for_training_step_code_names_it_once_and_plainly():
    advice = _rules(_history([60], [_outside(60, "model")]))["model"]
    assert advice.change == "fix the computation in training_step (outside any module): no precision setting helps"
    assert "((" not in advice.change + advice.evidence
