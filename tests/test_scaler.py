"""DynamicLossScaler on hand-made gradients, no Trainer."""

import io
import math

import pytest
import torch

from lightning_mp import DynamicLossScaler
from tests.helpers import HostSyncCounter


def _param(values, dtype=torch.float32, grad=None):
    p = torch.nn.Parameter(torch.tensor(values, dtype=dtype))
    p.grad = torch.tensor(grad if grad is not None else values, dtype=dtype)
    return p


def test_growth_after_exactly_growth_interval_finite_steps():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 8.0
    scaler.update(False)
    assert scaler.scale == 16.0
    for _ in range(2):
        scaler.update(False)
    assert scaler.scale == 16.0
    scaler.update(False)
    assert scaler.scale == 32.0
    assert scaler.skipped_steps == 0 and scaler.steps == 6


def test_growth_is_capped_at_max_scale():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=1, max_scale=12.0)
    scaler.update(False)
    assert scaler.scale == 12.0
    scaler.update(False)
    assert scaler.scale == 12.0


def test_overflow_halves_scale_counts_skip_and_resets_growth_count():
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=3)
    scaler.update(False)
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 32.0 and scaler.skipped_steps == 1
    # the two finite steps before the overflow no longer count towards growth
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 32.0
    scaler.update(False)
    assert scaler.scale == 64.0


def test_hysteresis_tolerates_overflows_then_backs_off():
    scaler = DynamicLossScaler(init_scale=64.0, hysteresis=3)
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 64.0 and scaler.skipped_steps == 2
    scaler.update(True)
    assert scaler.scale == 32.0 and scaler.skipped_steps == 3
    # the allowance stays used up until a finite step: the next overflow backs off at once
    scaler.update(True)
    assert scaler.scale == 16.0


def test_finite_step_restores_hysteresis():
    scaler = DynamicLossScaler(init_scale=64.0, hysteresis=3)
    for found_inf in (True, True, False, True, True):
        scaler.update(found_inf)
    assert scaler.scale == 64.0 and scaler.skipped_steps == 4
    scaler.update(True)
    assert scaler.scale == 32.0


def test_backoff_below_min_scale_raises_naming_the_nonfinite_parameters():
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=1.0)
    good = _param([1.0, 2.0])
    bad = _param([1.0, 2.0], grad=[float("inf"), 1.0])
    nan = _param([1.0], grad=[float("nan")])
    scaler.update(scaler.unscale_([("encoder.weight", good), ("decoder.weight", bad), ("head.bias", nan)]))
    assert scaler.scale == 1.0
    bad.grad = torch.tensor([float("inf"), 1.0])
    found_inf = scaler.unscale_([("encoder.weight", good), ("decoder.weight", bad), ("head.bias", nan)])
    with pytest.raises(FloatingPointError) as err:
        scaler.update(found_inf)
    message = str(err.value)
    assert "Loss scale 1 " in message and "min_scale=1" in message
    assert "decoder.weight" in message and "head.bias" in message
    assert "encoder.weight" not in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscale_accepts_fp32_fp16_bf16_grads(dtype):
    scaler = DynamicLossScaler(init_scale=1024.0)
    true_grad = torch.tensor([0.5, -0.25, 3.0, 1e-3], dtype=torch.float64)
    p = _param([0.0] * 4, dtype=dtype, grad=(true_grad * 1024.0).tolist())
    found_inf = scaler.unscale_([p])
    assert p.grad.dtype == dtype
    assert not DynamicLossScaler.found_inf(found_inf)
    # a power-of-two scale unscales exactly whatever the dtype rounded the scaled gradient to
    expected = torch.tensor((true_grad * 1024.0).tolist(), dtype=dtype).double() / 1024.0
    torch.testing.assert_close(p.grad.double(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_unscale_reports_nonfinite(dtype, bad):
    scaler = DynamicLossScaler()
    params = [_param([1.0, 2.0], dtype=dtype), _param([1.0, bad], dtype=dtype)]
    assert DynamicLossScaler.found_inf(scaler.unscale_(params))


def test_unscale_handles_mixed_dtypes_missing_and_sparse_grads():
    scaler = DynamicLossScaler(init_scale=4.0)
    half = _param([8.0], dtype=torch.float16)
    full = _param([4.0])
    no_grad = torch.nn.Parameter(torch.ones(2))
    emb = torch.nn.Embedding(5, 2, sparse=True)
    emb(torch.tensor([1, 1, 3])).sum().backward()  # duplicate index 1: coalesce sums it
    emb.weight.grad = emb.weight.grad * 4.0
    found_inf = scaler.unscale_([half, full, no_grad, emb.weight])
    assert not DynamicLossScaler.found_inf(found_inf)
    assert half.grad.item() == 2.0 and full.grad.item() == 1.0 and no_grad.grad is None
    dense = emb.weight.grad.to_dense()
    assert dense[1].tolist() == [2.0, 2.0] and dense[3].tolist() == [1.0, 1.0] and dense[0].tolist() == [0.0, 0.0]


def test_unscale_uses_the_scale_the_gradients_were_made_with():
    # manual optimization: one backward, then two optimizers step; the first one's overflow halves the scale,
    # the second one's gradients still carry the old scale
    scaler = DynamicLossScaler(init_scale=16.0)
    w1, w2 = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    loss = scaler.scale_loss((w1 * float("inf")).sum() + (w2 * 3.0).sum())
    loss.backward()
    scaler.update(scaler.unscale_([w1]))
    assert scaler.scale == 8.0
    assert not DynamicLossScaler.found_inf(scaler.unscale_([w2]))
    assert w2.grad.item() == 3.0


def test_scale_loss_multiplies_in_fp32():
    scaler = DynamicLossScaler(init_scale=2.0**16)
    loss = torch.tensor(4.0, dtype=torch.float16)  # 4 * 65536 overflows fp16, not fp32
    scaled = scaler.scale_loss(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 4.0 * 2.0**16


def test_static_scale_never_changes_but_still_reports_skips():
    scaler = DynamicLossScaler.static(128.0)
    for found_inf in [False] * 5000 + [True] * 20:
        scaler.update(found_inf)
    assert scaler.scale == 128.0 and scaler.skipped_steps == 20 and not scaler.dynamic


def test_disabled_scaler_is_a_no_op():
    scaler = DynamicLossScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale_loss(loss) is loss
    p = _param([5.0], grad=[float("inf")])
    assert not DynamicLossScaler.found_inf(scaler.unscale_([p]))
    assert math.isinf(p.grad.item())
    scaler.update(True)
    assert scaler.scale == 1.0 and scaler.skipped_steps == 0


def _drive(scaler, pattern):
    scales = []
    for found_inf in pattern:
        scaler.update(found_inf)
        scales.append(scaler.scale)
    return scales


def test_state_dict_round_trip_continues_bit_exactly():
    pattern = [False, False, True, False, True, True, False, False, False, False, True, False, False, False]
    settings = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2, backoff_factor=0.25, growth_factor=4.0)
    uninterrupted = DynamicLossScaler(**settings)
    full = _drive(uninterrupted, pattern)

    first = DynamicLossScaler(**settings)
    head = _drive(first, pattern[:5])
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = DynamicLossScaler()  # different settings: the checkpoint's win
    resumed.load_state_dict(torch.load(buffer))
    tail = _drive(resumed, pattern[5:])

    assert head + tail == full
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.skipped_steps == uninterrupted.skipped_steps == pattern.count(True)


#: A scaler checkpoint as the layout before issue 45 (``scaler.py`` with ``scaler_device.py``) wrote it, after the
#: first five steps of the pattern above with these settings: its keys, their order and their types are the format
#: every resume reads, and a checkpoint written before must load unchanged.
WRITTEN_BEFORE = {
    "scale": 1024.0,
    "growth_tracker": 0,
    "hysteresis_tracker": 1,
    "steps": 5,
    "skipped_steps": 2,
    "consecutive_skips": 1,
    "growth_factor": 4.0,
    "backoff_factor": 0.25,
    "growth_interval": 3,
    "hysteresis": 2,
    "min_scale": 1.0,
    "max_scale": 16777216.0,
    "dynamic": True,
    "check_only": False,
    "enabled": True,
    "max_consecutive_skips": 100,
}


@pytest.mark.parametrize("flags", ["bool", "tensor"], ids=["host", "device"])
def test_a_checkpoint_written_before_loads_unchanged_and_continues(flags):
    pattern = [False, False, True, False, True, True, False, False, False, False, True, False, False, False]
    settings = dict(init_scale=2.0**10, growth_interval=3, hysteresis=2, backoff_factor=0.25, growth_factor=4.0)
    as_flag = (lambda found: found) if flags == "bool" else (lambda found: torch.tensor(float(found)))
    uninterrupted = DynamicLossScaler(**settings)
    for found in pattern[:5]:
        uninterrupted.update(as_flag(found))
    written = uninterrupted.state_dict()
    assert list(written.items()) == list(WRITTEN_BEFORE.items())  # the same keys, order, values and types
    assert [type(value) for value in written.values()] == [type(value) for value in WRITTEN_BEFORE.values()]

    resumed = DynamicLossScaler()
    resumed.load_state_dict(dict(WRITTEN_BEFORE))
    assert list(resumed.state_dict().items()) == list(WRITTEN_BEFORE.items())
    for found in pattern[5:]:
        uninterrupted.update(as_flag(found))
        resumed.update(as_flag(found))
        assert resumed.state_dict() == uninterrupted.state_dict()


def test_load_state_dict_names_missing_keys():
    with pytest.raises(KeyError, match="growth_tracker"):
        DynamicLossScaler().load_state_dict({"scale": 2.0})


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(init_scale=0.0), "init_scale=0.0"),
        (dict(init_scale=-4.0), "init_scale=-4.0"),
        (dict(init_scale=float("inf")), "init_scale=inf"),
        (dict(growth_factor=1.0), "growth_factor=1.0"),
        (dict(growth_factor=0.5), "growth_factor=0.5"),
        (dict(backoff_factor=1.0), "backoff_factor=1.0"),
        (dict(backoff_factor=0.0), "backoff_factor=0.0"),
        (dict(growth_interval=0), "growth_interval=0"),
        (dict(hysteresis=0), "hysteresis=0"),
        (dict(min_scale=0.0), "min_scale=0.0"),
        (dict(min_scale=8.0, max_scale=4.0, init_scale=4.0), "min_scale=8.0"),
        (dict(init_scale=0.5, min_scale=1.0), "init_scale=0.5"),
    ],
)
def test_bad_settings_raise_value_error_naming_the_value(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")) as err:
        DynamicLossScaler(**kwargs)
    assert "must" in str(err.value) or "outside" in str(err.value)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan")])
def test_static_scale_must_be_positive(scale):
    with pytest.raises(ValueError, match="must be a finite number > 0"):
        DynamicLossScaler.static(scale)


def test_one_host_sync_per_step():
    scaler = DynamicLossScaler(init_scale=4.0)
    params = [("a", _param([1.0, 2.0])), ("b", _param([3.0], dtype=torch.float16))]
    with HostSyncCounter() as counter:
        loss = scaler.scale_loss(torch.tensor(1.0))
        found_inf = scaler.unscale_(params)
        skip = DynamicLossScaler.found_inf(found_inf)
        scaler.update(skip)
    assert loss.item() == 4.0
    assert counter.calls == ["item"]
