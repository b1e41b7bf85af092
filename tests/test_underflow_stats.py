"""Per-layer gradient statistics against fp16's range: exact counts vs a float64 computation at the 2**-14 and
2**-24 boundaries, with and without a scale; grouping; one host sync per sample and none on other steps."""

import math

import pytest
import torch

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, PrecisionMonitor
from lightning_mp.diagnostics.history import headroom_bits
from lightning_mp.diagnostics.underflow import grouped_stats, read_rows, tensor_stats
from tests.helpers import HostSyncCounter, TinyRegressor, make_trainer, regression_loader
from tests.planted import PlantedModel, fit_planted

# scaled magnitudes on both sides of each boundary (fp16's smallest subnormal 2**-24, smallest normal 2**-14)
_SCALED = [
    0.0,
    2.0**-30,
    2.0**-25,
    2.0**-24 * (1 - 2.0**-20),
    2.0**-24,
    2.0**-20,
    2.0**-14 * (1 - 2.0**-20),
    2.0**-14,
    1.0,
    3.0,
    60000.0,
]


def _reference(grad: torch.Tensor, scale: float) -> list[float]:
    """The same statistics computed in float64 on ``|grad| * scale``."""
    scaled = grad.double().abs() * scale
    zeros = int((scaled == 0).sum())
    flush = int(((scaled > 0) & (scaled < 2.0**-24)).sum())
    subnormal = int(((scaled >= 2.0**-24) & (scaled < 2.0**-14)).sum())
    return [float(grad.numel()), zeros, flush, subnormal, 0.0, float(scaled.max())]


@pytest.mark.parametrize("scale", [1.0, 2.0**10, 2.0**16, 2.0**24])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_counts_match_float64_at_the_2e14_and_2e24_boundaries_with_and_without_scale(scale, as_tensor):
    signs = torch.tensor([1.0, -1.0]).repeat(len(_SCALED))
    grad = (torch.tensor(_SCALED, dtype=torch.float64).repeat_interleave(2) * signs / scale).float()
    assert torch.equal(grad.double() * scale, torch.tensor(_SCALED).double().repeat_interleave(2) * signs)  # exact
    given = torch.tensor(scale) if as_tensor else scale
    row = tensor_stats(grad, given).tolist()
    expected = _reference(grad, scale)
    assert row == pytest.approx(expected, rel=0, abs=0)
    assert row[1:4] == [2, 6, 6]  # by hand: 2 zeros; 2**-30, 2**-25, just below 2**-24; 2**-24 .. just below 2**-14


def test_half_gradients_are_counted_in_their_own_dtype_at_scale_1_and_in_fp32_when_scaled():
    grad = torch.tensor([2.0**-24, 2.0**-15, 2.0**-14, 1.0], dtype=torch.float16)  # exact in fp16
    assert tensor_stats(grad).tolist() == [4, 0, 0, 2, 0, 1.0]
    # divided by 2**16 in fp32 the thresholds fall below fp16's range: the comparison must not happen in fp16
    assert tensor_stats(grad, 2.0**16).tolist() == [4, 0, 0, 0, 0, 2.0**16]
    bf16 = torch.tensor([0.0, 1e-30, 5.0], dtype=torch.bfloat16)
    row = tensor_stats(bf16).tolist()
    assert row[1] == 1 and row[5] == 5.0  # zeros and amax: what bf16 reports


def test_nonfinite_values_are_counted_and_make_amax_infinite_and_headroom_negative_infinity():
    row = tensor_stats(torch.tensor([1.0, math.inf, -2.0])).tolist()
    assert row[4] == 1 and row[5] == math.inf
    assert headroom_bits(row[5]) == -math.inf
    assert headroom_bits(65504.0 / 8) == 3.0
    assert headroom_bits(0.0) is None


def test_grouped_stats_sum_counts_and_take_the_largest_magnitude_per_module():
    pairs = [("a", torch.tensor([0.0, 1.0])), ("b", torch.tensor([4.0])), ("a", torch.tensor([0.0, -3.0, 2.0**-20]))]
    names, rows = grouped_stats(pairs, 1.0)
    ((a, b),) = read_rows(rows)
    assert names == ["a", "b"]
    assert a == [5, 2, 0, 1, 0, 3.0] and b == [1, 0, 0, 0, 0, 4.0]


def _syncs(monitor, steps=6):
    torch.manual_seed(0)
    trainer = make_trainer(
        MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)), callbacks=[monitor], max_steps=steps
    )
    with HostSyncCounter() as counter:
        trainer.fit(TinyRegressor(record_grad_norms=False), regression_loader())
    return counter.calls, monitor


def test_one_host_sync_per_sample_and_none_on_steps_neither_sampled_nor_skipped():
    baseline, _ = _syncs(PrecisionMonitor(localise_overflows=False, sample_every=0, report=False))
    localising, _ = _syncs(PrecisionMonitor(localise_overflows=True, sample_every=0, report=False))
    sampled, monitor = _syncs(PrecisionMonitor(sample_every=3, report=False))
    with_activations, _ = _syncs(PrecisionMonitor(sample_every=3, activation_grads=True, report=False))
    assert [s.step for s in monitor.history.samples] == [0, 3]
    assert len(localising) == len(baseline)  # no skip in 6 steps: localisation costs nothing
    assert len(sampled) == len(baseline) + 2 and sampled.count("tolist") == 2  # steps 0 and 3, one sync each
    assert len(with_activations) == len(sampled)  # activation statistics travel in the same transfer


def test_activation_hooks_run_only_on_sampled_steps_and_cover_every_leaf_module():
    hooked = []

    class Probe(TinyRegressor):
        def training_step(self, batch, batch_idx):
            hooked.append(sum(len(m._forward_hooks) for m in self.modules()))
            return super().training_step(batch, batch_idx)

    monitor = PrecisionMonitor(sample_every=4, activation_grads=True, report=False)
    trainer = make_trainer(
        MixedPrecisionPlugin(scaler=DynamicLossScaler(init_scale=1024.0)), callbacks=[monitor], max_steps=6
    )
    trainer.fit(Probe(record_grad_norms=False), regression_loader())
    assert hooked == [3, 0, 0, 0, 3, 0]  # Linear, Tanh, Linear at steps 0 and 4
    activations = monitor.history.samples_of("activation_grads")
    assert [s.step for s in activations] == [0, 4]
    assert activations[0].layers == ["net.0", "net.1", "net.2"]  # model order (the same on every rank)
    assert activations[0].column("numel") == [64.0, 64.0, 8.0]  # batch 8 x (8, 8, 1)


def test_master_weights_sample_the_fp32_master_gradients_named_as_the_model():
    _, monitor = fit_planted(
        PlantedModel(), monitor=PrecisionMonitor(sample_every=2, report=False), master_weights=True, steps=3
    )
    sample = monitor.history.samples[0]
    assert sample.layers == ["net.0", "net.4"] and sample.column("numel") == [40.0, 9.0]
    assert sample.scale == 1024.0 and all(h is not None and h > 0 for h in sample.headroom())


def test_bf16_samples_zeros_and_amax_with_scale_1():
    _, monitor = fit_planted(
        PlantedModel(), monitor=PrecisionMonitor(sample_every=1, report=False), precision="bf16-mixed", steps=2
    )
    assert monitor.history.precision == "bf16"
    assert [s.scale for s in monitor.history.samples] == [1.0, 1.0]
    assert all(amax > 0 for amax in monitor.history.samples[0].column("amax"))
