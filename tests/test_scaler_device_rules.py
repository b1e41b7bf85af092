"""The scaler's rules on the device (three ops a step: ``bucketize``, ``index_select``, ``addcmul``, with the table
generated from :mod:`lightning_mp.scaler.rules`) against the same rules applied on the host
(:func:`lightning_mp.scaler.rules.update`), step by step, for any settings and any sequence of flags.

Two scalers start alike: one is updated with the flag tensor (``update(found_inf)``: the device path, the host
deciding only the steps where an error or the ``max_scale`` cap may be due), the other with the flag already read
(``update(bool)``: the host applies the rules' table). After every step their whole state is the same (scale,
growth and hysteresis trackers, skipped and consecutive counts), each error is raised at the same step with the same
reason, and a state saved from the device path at any step continues identically after a load. The flags include
sums over ranks (2, 3: what a DDP all-reduce of the flag gives) and settings that reach hysteresis > 1, a growth
clipped by ``max_scale`` (on and off the growth ladder), non-power-of-two factors, static and check-only scalers.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_mp import DynamicLossScaler
from lightning_mp.scaler import rules
from lightning_mp.scaler.device import GROW_EDGE, GROWTH, HYSTERESIS, SLOTS, edges, transition_table
from lightning_mp.scaler.rules import Rules, ScalerState


@st.composite
def scalers(draw: st.DrawFn) -> tuple[dict, str]:
    kind = draw(st.sampled_from(["dynamic", "dynamic", "dynamic", "static", "check_only"]))
    if kind != "dynamic":
        return {"scale": draw(st.sampled_from([1.0, 3.0, 1024.0])), "skips": draw(st.sampled_from([None, 3, 7]))}, kind
    growth = draw(st.sampled_from([2.0, 1.5, 3.0, 1.0 + 2.0**-20]))
    init = draw(st.sampled_from([2.0**4, 3.0, 1000.1, 2.0**16]))
    # the cap: the scale itself, a few growths above it on the ladder, or off the ladder
    max_scale = init * draw(st.sampled_from([1.0, growth, growth**2, 2.5, 7.3, 2.0**10]))
    return {
        "init_scale": init,
        "growth_factor": growth,
        "backoff_factor": draw(st.sampled_from([0.5, 0.25, 0.7, 1.0 / 3.0])),
        "growth_interval": draw(st.integers(1, 4)),
        "hysteresis": draw(st.integers(1, 4)),
        "min_scale": init * draw(st.sampled_from([2.0**-30, 2.0**-3, 0.3])),
        "max_scale": max_scale,
        "max_consecutive_skips": draw(st.sampled_from([None, 4, 9])),
    }, kind


def _make(config: dict, kind: str) -> DynamicLossScaler:
    if kind == "static":
        return DynamicLossScaler.static(config["scale"], max_consecutive_skips=config["skips"])
    if kind == "check_only":
        return DynamicLossScaler.check_only(max_consecutive_skips=config["skips"])
    return DynamicLossScaler(**config)


def _state(scaler: DynamicLossScaler) -> dict:
    state = scaler.state_dict()
    state.pop("steps")  # counted on the host by both
    return state


def _step(scaler: DynamicLossScaler, flag: object) -> Optional[str]:
    try:
        scaler.update(flag)  # type: ignore[arg-type]
    except FloatingPointError as error:
        return str(error).split(" Non-finite")[0]
    return None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scaler=scalers(),
    flags=st.lists(st.sampled_from([0, 0, 0, 1, 1, 2, 3]), min_size=1, max_size=40),
    read_every=st.sampled_from([1, 3, 1000]),
    resume_at=st.one_of(st.none(), st.integers(0, 39)),
)
def test_device_rules_equal_host_rules_after_every_step(
    scaler: tuple[dict, str], flags: list[int], read_every: int, resume_at: Optional[int]
) -> None:
    config, kind = scaler
    device, host = _make(config, kind), _make(config, kind)
    for index, value in enumerate(flags):
        expected = _step(host, value > 0)
        got = _step(device, torch.tensor(float(value)))
        assert got == expected, f"step {index}: device {got!r}, host {expected!r}"
        if expected is not None:
            return
        if (index + 1) % read_every == 0 or index + 1 == len(flags):
            assert _state(device) == _state(host), f"after step {index} ({flags[: index + 1]})"
        if resume_at == index:  # a checkpoint taken from the device path continues identically
            resumed = _make(config, kind)
            resumed.load_state_dict(device.state_dict())
            device = resumed
    assert device.scale == host.scale and device.skipped_steps == host.skipped_steps


def test_a_long_run_stays_on_the_device_and_reads_back_exactly() -> None:
    """Hysteresis 3, growth every 2 finite steps, the cap reached: 300 seeded steps, read once at the end."""
    config = dict(init_scale=2.0**10, growth_interval=2, hysteresis=3, max_scale=2.0**14, max_consecutive_skips=None)
    device, host = DynamicLossScaler(**config), DynamicLossScaler(**config)
    generator = torch.Generator().manual_seed(0)
    flags = (torch.rand(300, generator=generator) < 0.3).tolist()
    on_device = 0
    for flag in flags:
        host.update(flag)
        before = device.pending_updates
        device.update(torch.tensor(float(flag)))
        on_device += device.pending_updates == before + 1
    # the host decides only the steps where an error or the cap may be due: at the cap, each step that could grow
    assert on_device > 100
    assert _state(device) == _state(host)
    assert host.scale == 2.0**14 or host.skipped_steps > 0


def _rules(dynamic: bool, interval: int, hysteresis: int) -> Rules:
    return Rules(dynamic, 2.0, 0.5, interval, hysteresis, 1.0, 2.0**24, None)


@pytest.mark.parametrize("dynamic", [True, False])
def test_the_edges_sort_every_flag_into_the_case_of_the_host_rule(dynamic: bool) -> None:
    """``bucketize(flag, edges)`` gives the case :func:`lightning_mp.scaler.rules.case` takes, for trackers around
    every threshold and for flags summed over ranks."""
    interval, hysteresis = 3, 3
    settings = _rules(dynamic, interval, hysteresis)
    for growth in range(0, interval + 3):  # past the interval: possible after a load
        for left in range(0, hysteresis + 1):
            state = ScalerState(8.0, growth_tracker=growth, hysteresis_tracker=left)
            bounds = torch.tensor(edges(state, settings), dtype=torch.float64)
            assert bounds.tolist() == sorted(bounds.tolist())
            for flag in (0.0, 1.0, 2.0, 64.0):
                case = int(torch.bucketize(torch.tensor(flag), bounds))
                assert case == rules.case(state, flag > 0, settings), (growth, left, flag)


@pytest.mark.parametrize("dynamic", [True, False])
def test_the_generated_table_is_the_host_rule_and_keeps_the_edges_in_step(dynamic: bool) -> None:
    """Each row of the generated table, applied to a state, gives the counters the host's table gives
    (:func:`lightning_mp.scaler.rules.apply`) and moves the edges to those of the new trackers (what the next step
    sorts by)."""
    interval, hysteresis = 3, 3
    settings = _rules(dynamic, interval, hysteresis)
    table = transition_table(settings)
    for growth in range(interval):
        for left in range(hysteresis + 1):
            state = ScalerState(8.0, growth_tracker=growth, hysteresis_tracker=left, skipped_steps=5)
            vector = torch.tensor([8.0, growth, left, 5, 0, 0, *edges(state, settings)], dtype=torch.float64)
            for flag in (0.0, 1.0):
                case = int(torch.bucketize(torch.tensor(flag), vector[GROW_EDGE:]))
                new = vector * table[case, :SLOTS] + table[case, SLOTS:]
                host = rules.apply(case, state, settings)
                assert new[: len(rules.COUNTERS)].tolist() == [getattr(host, name) for name in rules.COUNTERS]
                moved = ScalerState(8.0, growth_tracker=int(new[GROWTH]), hysteresis_tracker=int(new[HYSTERESIS]))
                assert new[GROW_EDGE:].tolist() == edges(moved, settings)
