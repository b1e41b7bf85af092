"""The loss scaler's rules, each written once: growth, backoff, hysteresis, the ``min_scale`` / ``max_scale`` limits,
``max_consecutive_skips``, and from them the horizon before which no error can be due.

A step's found-inf flag and the state sort it into one of four cases (:func:`case`): a finite step that grows the
scale, one that does not, a non-finite step that keeps the scale (hysteresis left), one that backs off. What each case
does to each counter is one affine map, ``new = old * multiplier + addend``, in one table (:data:`DYNAMIC`, and
:data:`STATIC` for a scaler whose scale never moves). Both forms of the update come from it:

- the host applies it in :func:`update` (with the limits that need a decision: the cap at ``max_scale``, the errors);
- :mod:`lightning_mp.scaler.device` generates the device's transition table from it, and keeps the thresholds of
  :func:`case` as edges in the device state (``tests/test_scaler_device_rules.py`` checks the generated table
  against :func:`update` after every step, for any settings and any sequence of flags).

:func:`steps_before_an_error_may_be_due` walks the same table's scale multipliers to say from which step an update must
be decided on the host, so that errors (and a growth the ``max_scale`` cap clips) happen at the step they are due.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional, Union

#: The cases of a step, in the order the device's ``torch.bucketize`` numbers them.
GROW, FINITE, SKIP, BACKOFF = range(4)
#: The counters the rules move, in the order of the device state (``steps`` is counted by the host alone).
COUNTERS = ("scale", "growth_tracker", "hysteresis_tracker", "skipped_steps", "consecutive_skips")

#: A multiplier or an addend: a number, or the name of a setting standing for its value.
Term = Union[int, str]
Affine = tuple[Term, Term]  # (multiplier, addend): new = old * multiplier + addend
KEEP: Affine = (1, 0)
RESET: Affine = (0, 0)
COUNT: Affine = (1, 1)
RESTORE: Affine = (0, "hysteresis")  # a finite step restores the hysteresis allowance
USE_ONE: Affine = (1, -1)  # a non-finite step with hysteresis left uses one unit of it
GROW_BY: Affine = ("growth_factor", 0)
BACK_OFF: Affine = ("backoff_factor", 0)

# fmt: off
#: What each case does to each counter of a dynamic scaler (the columns in the order of :data:`COUNTERS`).
DYNAMIC: dict[int, dict[str, Affine]] = {
    #                          scale     growth   hysteresis  skipped  consecutive
    GROW:    dict(zip(COUNTERS, (GROW_BY,  RESET,   RESTORE,    KEEP,    RESET))),
    FINITE:  dict(zip(COUNTERS, (KEEP,     COUNT,   RESTORE,    KEEP,    RESET))),
    SKIP:    dict(zip(COUNTERS, (KEEP,     RESET,   USE_ONE,    COUNT,   COUNT))),
    BACKOFF: dict(zip(COUNTERS, (BACK_OFF, RESET,   RESET,      COUNT,   COUNT))),
}
#: A static (or check-only) scaler: the scale and the growth tracker never move and hysteresis is never used, so its
#: steps are only ``FINITE`` or ``SKIP``; the skips are still counted (``max_consecutive_skips`` still holds).
STATIC: dict[int, dict[str, Affine]] = {
    FINITE:  dict(zip(COUNTERS, (KEEP,     KEEP,    RESTORE,    KEEP,    RESET))),
    SKIP:    dict(zip(COUNTERS, (KEEP,     KEEP,    KEEP,       COUNT,   COUNT))),
}
# fmt: on


@dataclass
class ScalerState:
    """A loss scaler's counters: what a step changes (the settings, :class:`Rules`, it does not)."""

    scale: float
    growth_tracker: int = 0
    hysteresis_tracker: int = 1
    steps: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0


class Rules(NamedTuple):
    """A scaler's settings, as its rules read them (a tuple: the device rebuilds its table when they change)."""

    dynamic: bool
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float
    max_consecutive_skips: Optional[int]


def table(rules: Rules) -> dict[int, dict[str, Affine]]:
    """The table for ``rules``: :data:`DYNAMIC` or :data:`STATIC`."""
    return DYNAMIC if rules.dynamic else STATIC


def value(term: Term, rules: Rules) -> Union[int, float]:
    """A term of the table: a number as it is, a setting's name as that setting's value."""
    return getattr(rules, term) if isinstance(term, str) else term


def case(state: ScalerState, found_inf: bool, rules: Rules) -> int:
    """The case of a step: a finite step grows the scale when it completes ``growth_interval`` finite steps in a row;
    a non-finite one backs off when at most one unit of hysteresis is left. A static scaler never grows nor backs off.
    (:mod:`lightning_mp.scaler.device` keeps these two thresholds as the edges ``torch.bucketize`` sorts by.)"""
    if not found_inf:
        return GROW if rules.dynamic and state.growth_tracker + 1 >= rules.growth_interval else FINITE
    return BACKOFF if rules.dynamic and state.hysteresis_tracker <= 1 else SKIP


@functools.lru_cache(maxsize=16)
def resolved(rules: Rules) -> dict[int, tuple[tuple[str, Union[int, float], Union[int, float]], ...]]:
    """The table for ``rules`` with every term replaced by its number, per case ``(counter, multiplier, addend)``:
    made once per settings, so that a step's update on the host is one pass over five numbers."""
    return {
        which: tuple((name, value(row[name][0], rules), value(row[name][1], rules)) for name in COUNTERS)
        for which, row in table(rules).items()
    }


def apply(which: int, state: ScalerState, rules: Rules) -> ScalerState:
    """The table's row ``which`` applied to ``state`` (and ``steps`` counted): before the limits of :func:`update`."""
    new = {name: getattr(state, name) * multiplier + addend for name, multiplier, addend in resolved(rules)[which]}
    return ScalerState(steps=state.steps + 1, **new)


class Step(NamedTuple):
    """One step of the rules on the host: the new state, the step's case, the reason of its error (``None``: none)."""

    state: ScalerState
    case: int
    error: Optional[str]


def update(state: ScalerState, found_inf: bool, rules: Rules) -> Step:
    """One step of the rules on the host: the new state, the step's case, and the reason of an error when the step
    raises one.

    A growth is capped at ``max_scale``. ``max_consecutive_skips`` non-finite steps in a row are an error (the skip is
    counted, nothing else changes); so is a backoff that would take the scale below ``min_scale`` (the step is counted
    and the trackers move, the scale stays)."""
    which = case(state, found_inf, rules)
    new = apply(which, state, rules)
    limit = rules.max_consecutive_skips
    if found_inf and limit is not None and new.consecutive_skips >= limit:
        reason = (
            f"{new.consecutive_skips} optimizer steps in a row had non-finite gradients and were skipped "
            f"(max_consecutive_skips={limit}, scale {state.scale:g}{', static' if not rules.dynamic else ''}): "
            "training is not progressing."
        )
        counts = {name: getattr(new, name) for name in ("steps", "skipped_steps", "consecutive_skips")}
        return Step(replace(state, **counts), which, reason)
    if which == BACKOFF and new.scale < rules.min_scale:
        reason = (
            f"Loss scale {state.scale:g} cannot back off below min_scale={rules.min_scale:g} "
            f"(backoff_factor={rules.backoff_factor:g}): gradients are non-finite even at the minimum scale."
        )
        return Step(replace(new, scale=state.scale), which, reason)
    if which == GROW:
        new.scale = min(new.scale, rules.max_scale)
    return Step(new, which, None)


def steps_before_an_error_may_be_due(state: ScalerState, rules: Rules, limit: int = 1000) -> int:
    """From a known state, the number of the first step (1 = the next one) at which :func:`update` could raise
    (``max_consecutive_skips`` reached, or a backoff below ``min_scale``) or the ``max_scale`` cap could clip a
    growth. Every step before it is safe to update on the device; that step is decided on the host. At most ``limit``
    (deciding earlier is always safe).

    The fastest way to either error is a run of non-finite steps: a finite step resets the run, restores the
    hysteresis allowance and may grow the scale, which only moves the errors further away. The fastest way to the
    cap is a run of finite steps: one growth every ``growth_interval`` of them (the first after
    ``growth_interval - growth_tracker``); a back-off only moves it away (the margin covers the roundings of a
    back-off and a growth that do not cancel exactly, over ``limit`` steps).
    """
    due = limit
    if rules.max_consecutive_skips is not None:
        due = min(due, max(rules.max_consecutive_skips - state.consecutive_skips, 1))
    if rules.dynamic:
        backoff = value(DYNAMIC[BACKOFF]["scale"][0], rules)
        backoffs, scale = 0, state.scale
        while scale * backoff >= rules.min_scale and backoffs < limit:
            scale *= backoff
            backoffs += 1
        due = min(due, max(state.hysteresis_tracker, 1) + backoffs)  # the first backoff, then one per non-finite step
        growth = value(DYNAMIC[GROW]["scale"][0], rules)
        growths, scale = 0, state.scale
        while scale * growth * (1.0 + 2.0**-40) <= rules.max_scale and growths < limit:
            scale *= growth
            growths += 1
        due = min(due, max(rules.growth_interval - state.growth_tracker, 1) + growths * rules.growth_interval)
    return due
