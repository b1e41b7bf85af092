"""Property-based tests of DynamicLossScaler (hypothesis): any valid settings, any sequence of steps.

Each step builds hand-made fp32/fp16/bf16 gradients (in [-1, 1], inf/NaN planted on the non-finite steps),
runs the real check path (``scale_loss`` -> ``unscale_`` -> ``found_inf`` -> ``update``) and compares the
scaler with ``ReferenceScaler``, a small pure-Python statement of the documented rules written here on its own:

- a finite step restores the hysteresis allowance and counts towards growth; after ``growth_interval``
  finite steps in a row the scale is multiplied by ``growth_factor``, capped at ``max_scale``;
- a non-finite step is counted as skipped, resets the growth count and uses one unit of hysteresis; once the
  allowance is used up (and until a finite step restores it) the scale is multiplied by ``backoff_factor``;
- a backoff that would take the scale below ``min_scale`` raises ``FloatingPointError`` naming the
  parameters whose gradients were non-finite, and only then;
- a static scaler never changes its scale and still reports skipped steps.

And ``state_dict()`` -> a new scaler -> ``load_state_dict()`` at any point continues identically.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lightning_mp import DynamicLossScaler

# the hand-made parameters: (name, dtype, shape)
PARAMS = [
    ("encoder.weight", torch.float32, (3,)),
    ("decoder.weight", torch.float16, (2, 2)),
    ("head.bias", torch.bfloat16, (4,)),
]
NONFINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
# the smallest positive (subnormal) value of each dtype: what an unscaled value may round to
SMALLEST = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}
MAX_STEPS = 40  # well below any limit on consecutive skipped steps


class BackoffBelowMin(Exception):
    pass


@dataclass
class ReferenceScaler:
    """The documented rules, in plain Python (no torch, no code shared with lightning_mp)."""

    scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float
    dynamic: bool = True
    finite_in_a_row: int = 0
    nonfinite_since_finite: int = 0
    steps: int = 0
    skipped_steps: int = 0

    def step(self, nonfinite: bool) -> None:
        self.steps += 1
        if not nonfinite:
            self.nonfinite_since_finite = 0
            if self.dynamic:
                self.finite_in_a_row += 1
                if self.finite_in_a_row == self.growth_interval:
                    self.finite_in_a_row = 0
                    self.scale = min(self.scale * self.growth_factor, self.max_scale)
            return
        self.skipped_steps += 1
        if not self.dynamic:
            return
        self.finite_in_a_row = 0
        self.nonfinite_since_finite += 1
        if self.nonfinite_since_finite < self.hysteresis:
            return  # tolerated
        backed_off = self.scale * self.backoff_factor
        if backed_off < self.min_scale:
            raise BackoffBelowMin
        self.scale = backed_off


@st.composite
def scaler_settings(draw) -> dict:
    """Any valid DynamicLossScaler settings, scales kept in a range an fp32 tensor holds comfortably."""
    min_scale = draw(st.one_of(st.sampled_from([2.0**-4, 1.0, 2.0]), st.floats(2.0**-8, 2.0**8)))
    max_scale = min_scale * draw(st.one_of(st.sampled_from([1.0, 2.0**4, 2.0**24]), st.floats(1.0, 2.0**24)))
    init_scale = draw(st.one_of(st.sampled_from([min_scale, max_scale]), st.floats(min_scale, max_scale)))
    return dict(
        init_scale=init_scale,
        growth_factor=draw(st.one_of(st.just(2.0), st.floats(1.0, 8.0, exclude_min=True))),
        backoff_factor=draw(st.one_of(st.just(0.5), st.floats(0.05, 0.95))),
        growth_interval=draw(st.integers(1, 5)),
        hysteresis=draw(st.integers(1, 4)),
        min_scale=min_scale,
        max_scale=max_scale,
    )


# a step: None (finite) or where to plant a non-finite value: (parameter index, element index, kind)
step_strategy = st.one_of(
    st.none(), st.tuples(st.integers(0, len(PARAMS) - 1), st.integers(0, 3), st.sampled_from(sorted(NONFINITE)))
)
# steps come in runs of the same kind, so that growth intervals and hysteresis allowances get used up
step_sequences = st.lists(st.tuples(step_strategy, st.integers(1, 6)), min_size=1, max_size=12).map(
    lambda runs: [step for step, length in runs for _ in range(length)][:MAX_STEPS]
)


def _make_scaler(config: dict, static: bool) -> DynamicLossScaler:
    return DynamicLossScaler.static(config["init_scale"]) if static else DynamicLossScaler(**config)


def _reference(scaler: DynamicLossScaler) -> ReferenceScaler:
    """The reference starts from the scaler's settings as constructed (static() picks its own bounds)."""
    return ReferenceScaler(
        scale=scaler.scale,
        growth_factor=scaler.growth_factor,
        backoff_factor=scaler.backoff_factor,
        growth_interval=scaler.growth_interval,
        hysteresis=scaler.hysteresis,
        min_scale=scaler.min_scale,
        max_scale=scaler.max_scale,
        dynamic=scaler.dynamic,
    )


def _hand_made_grads(generator: torch.Generator, plant: Optional[tuple]) -> list[tuple[str, torch.nn.Parameter]]:
    named = []
    for name, dtype, shape in PARAMS:
        param = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        param.grad = (torch.rand(shape, generator=generator) * 2 - 1).to(dtype)
        named.append((name, param))
    if plant is not None:
        index, element, kind = plant
        grad = named[index][1].grad
        grad.view(-1)[element % grad.numel()] = NONFINITE[kind]
    return named


def _one_step(scaler: DynamicLossScaler, named: list[tuple[str, torch.nn.Parameter]], nonfinite: bool) -> None:
    """The real path of one step: scale_loss (records the scale the gradients carry), unscale_, found_inf,
    update. Checks the flag and, on a finite step, that every gradient was divided by the scale once."""
    scale = scaler.scale
    assert scaler.scale_loss(torch.ones((), dtype=torch.float32)).item() == pytest.approx(scale, rel=2**-23)
    before = [p.grad.clone() for _, p in named]
    skip = scaler.found_inf(scaler.unscale_(named))
    assert skip == nonfinite
    if not nonfinite:
        for (_, p), grad in zip(named, before):
            eps = torch.finfo(grad.dtype).eps
            expected = grad.double() / scale
            torch.testing.assert_close(p.grad.double(), expected, rtol=2 * eps, atol=SMALLEST[grad.dtype])
    scaler.update(skip)


def _same_state(scaler: DynamicLossScaler, ref: ReferenceScaler) -> None:
    assert scaler.scale == ref.scale
    assert scaler.steps == ref.steps
    assert scaler.skipped_steps == ref.skipped_steps
    assert scaler.min_scale <= scaler.scale <= scaler.max_scale


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=scaler_settings(),
    static=st.booleans(),
    steps=step_sequences,
    round_trip_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_scale_follows_the_rules_and_round_trips_through_state_dict_at_any_step(
    config, static, steps, round_trip_fraction, seed
):
    round_trip_at = int(round_trip_fraction * len(steps))  # == len(steps): no round trip
    scaler = _make_scaler(config, static)
    ref = _reference(scaler)
    generator = torch.Generator().manual_seed(seed)
    resumed: Optional[DynamicLossScaler] = None
    for index, plant in enumerate(steps):
        if index == round_trip_at:
            event("round trip through state_dict")
            # a checkpoint at this point, loaded into a scaler built with other settings, continues identically
            state = scaler.state_dict()
            resumed = DynamicLossScaler()
            resumed.load_state_dict(state)
            assert resumed.state_dict() == state
        nonfinite = plant is not None
        named = _hand_made_grads(generator, plant)
        copies = [(name, torch.nn.Parameter(p.detach().clone())) for name, p in named]
        for (_, copy), (_, p) in zip(copies, named):
            copy.grad = p.grad.clone()
        try:
            ref.step(nonfinite)
        except BackoffBelowMin:
            event("backoff below min_scale")
            # exactly when a backoff would go below min_scale: an error naming the planted parameter
            for candidate, params in ((scaler, named), (resumed, copies)):
                if candidate is None:
                    continue
                with pytest.raises(FloatingPointError, match=re.escape(PARAMS[plant[0]][0])):
                    _one_step(candidate, params, nonfinite)
            return
        scale_before = scaler.scale
        _one_step(scaler, named, nonfinite)
        _same_state(scaler, ref)
        event("grew" if scaler.scale > scale_before else "backed off" if scaler.scale < scale_before else "kept")
        if resumed is not None:
            _one_step(resumed, copies, nonfinite)
            _same_state(resumed, ref)
            assert resumed.state_dict() == scaler.state_dict()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=scaler_settings(),
    static=st.booleans(),
    steps=step_sequences,
    max_consecutive_skips=st.one_of(st.none(), st.integers(1, 8)),
    read_every=st.integers(1, 50),
    seed=st.integers(0, 2**16),
)
def test_rules_on_the_device_match_the_reference_with_lazy_reads_and_errors_at_the_step_they_are_due(
    config, static, steps, max_consecutive_skips, read_every, seed
):
    """``update(found_inf tensor)``: the rules run as tensor ops and the host reads the state only every
    ``read_every`` steps (or when an error may be due); the state read equals the reference, and each error
    (backoff below ``min_scale``, ``max_consecutive_skips`` reached) is raised at exactly the step the reference
    raises it, naming the planted parameter."""
    scaler = _make_scaler(config, static)
    scaler.max_consecutive_skips = max_consecutive_skips
    ref = _reference(scaler)
    generator = torch.Generator().manual_seed(seed)
    in_a_row = 0
    for index, plant in enumerate(steps):
        nonfinite = plant is not None
        in_a_row = in_a_row + 1 if nonfinite else 0
        named = _hand_made_grads(generator, plant)
        expected_error = None
        if max_consecutive_skips is not None and in_a_row >= max_consecutive_skips:
            expected_error = "in a row"
        else:
            try:
                ref.step(nonfinite)
            except BackoffBelowMin:
                expected_error = "min_scale"
        scaler.scale_loss(torch.ones(()))
        found_inf = scaler.unscale_(named)
        if expected_error is not None:
            event(f"error: {expected_error}")
            with pytest.raises(FloatingPointError, match=f"{expected_error}.*{re.escape(PARAMS[plant[0]][0])}"):
                scaler.update(found_inf)
            return
        scaler.update(found_inf)
        if scaler.pending_updates:
            event("updates pending on the device")
        if (index + 1) % read_every == 0:
            _same_state(scaler, ref)
            assert scaler.consecutive_skips == in_a_row
    _same_state(scaler, ref)
    assert scaler.consecutive_skips == in_a_row
