"""The loss scaler's state on the device: one float64 vector, updated there by the rules as tensor ops, read by the
host lazily.

Nothing here decides when a step happens (that is :mod:`lightning_mp.stepping`) nor what the rules are (that is
:mod:`lightning_mp.scaler.rules`): :class:`DeviceState` takes the host's :class:`~lightning_mp.scaler.rules.ScalerState`
and :class:`~lightning_mp.scaler.rules.Rules`, and returns the state when it reads it back. It applies the rules in
three ops (the flag sorted into a case by :func:`edges` kept in the state, that case's affine map from
:func:`transition_table`, generated from the rules' table); the host decides the steps from
:func:`~lightning_mp.scaler.rules.steps_before_an_error_may_be_due` on, so that errors (and a growth the ``max_scale``
cap clips) happen at the step they are due.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from lightning_mp.scaler import rules as scaler_rules
from lightning_mp.scaler.rules import BACKOFF, FINITE, GROW, SKIP, Rules, ScalerState

#: Positions in the scaler's device state, one float64 vector (float64 so that the scale is the exact product the
#: rules state in Python floats, and the counters are exact integers up to 2**53): the counters of the rules' table in
#: its order, the last flag, then the edges that sort a step's found-inf flag into its case (see :func:`edges`).
SCALE, GROWTH, HYSTERESIS, SKIPPED, CONSECUTIVE, LAST_FOUND, GROW_EDGE, MIDDLE, BACKOFF_EDGE = range(9)
SLOTS = 9
#: the slot of each counter of the rules' table
_SLOT_OF = dict(zip(scaler_rules.COUNTERS, (SCALE, GROWTH, HYSTERESIS, SKIPPED, CONSECUTIVE)))
#: A back-off edge step per unit of hysteresis: larger than any flag (a flag summed over ranks is at most their count)
_STEP = 2.0**20


def device_state(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` (in the order above) as the float64 state vector on ``device``, without waiting for it."""
    return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


def edges(state: ScalerState, rules: Rules) -> list[float]:
    """The ``GROW_EDGE, MIDDLE, BACKOFF_EDGE`` slots for a state: the thresholds of
    :func:`~lightning_mp.scaler.rules.case`, sorted as ``torch.bucketize`` needs them.

    A finite flag (0) counts the edges below 0: the grow edge ``growth_tracker + 1 - growth_interval`` (at most 0)
    is below 0 exactly when the step does not grow the scale. A non-finite flag (1 or more) counts the edges below
    it: the grow edge and the middle (0.25) always, the back-off edge (0.5 while at most one unit of hysteresis is
    left, ``_STEP`` more per further unit) exactly when the step backs off. A static scaler's edges never move:
    every finite step is case ``FINITE``, every non-finite one ``SKIP``.
    """
    if not rules.dynamic:
        return [-1.0, 0.25, _STEP + 0.5]
    # (a tracker at or past the interval, possible after a load, grows at the next finite step: edge 0)
    grow = min(state.growth_tracker + 1 - rules.growth_interval, 0)
    return [float(grow), 0.25, _backoff_edge(state.hysteresis_tracker)]


def _backoff_edge(hysteresis_tracker: float) -> float:
    return 0.5 if hysteresis_tracker <= 1 else _STEP * (hysteresis_tracker - 1) + 0.5


def transition_table(rules: Rules) -> torch.Tensor:
    """The rules' table (:data:`~lightning_mp.scaler.rules.DYNAMIC` or ``STATIC``) for ``rules`` as one affine map
    per case: row ``case`` holds the multipliers of every slot, then what is added (``new = old * multiplier +
    addend``, exact: each multiplier is 0, 1 or a factor, each addend an integer or a quarter). The edges follow the
    trackers they encode; the last flag is remembered. What the table leaves out, the host decides: a growth that
    the ``max_scale`` cap may clip, a back-off below ``min_scale``, ``max_consecutive_skips``."""
    table = scaler_rules.table(rules)
    rows = []
    for case in (GROW, FINITE, SKIP, BACKOFF):
        finite = case in (GROW, FINITE)
        # a static scaler has no GROW nor BACKOFF case (its edges never select them): the row of its kind stands in
        row = table.get(case, table[FINITE if finite else SKIP])
        pairs = [(1.0, 0.0)] * SLOTS
        for name, (multiplier_term, addend_term) in row.items():
            pairs[_SLOT_OF[name]] = (
                float(scaler_rules.value(multiplier_term, rules)),
                float(scaler_rules.value(addend_term, rules)),
            )
        pairs[LAST_FOUND] = (0.0, 0.0 if finite else 1.0)
        if rules.dynamic:  # the edges follow the trackers (a static scaler's never move)
            multiplier, addend = pairs[GROWTH]  # the grow edge: growth tracker + 1 - growth_interval
            pairs[GROW_EDGE] = (multiplier, addend + (1 - multiplier) * (1 - rules.growth_interval))
            multiplier, addend = pairs[HYSTERESIS]  # the back-off edge: _STEP more per unit of hysteresis above 1
            pairs[BACKOFF_EDGE] = (0.0, _backoff_edge(addend)) if multiplier == 0 else (multiplier, _STEP * addend)
        rows.append([pair[0] for pair in pairs] + [pair[1] for pair in pairs])
    return torch.tensor(rows, dtype=torch.float64)


class DeviceState:
    """A loss scaler's state as one float64 vector on the device, updated there; read by the host lazily.

    One update is three ops whatever the settings: ``torch.bucketize`` sorts the flag into a case of the rules
    against edges kept in the state, ``torch.index_select`` takes that case's affine map from the table, and one
    ``torch.addcmul`` applies it to the whole state; a dynamic scaler then makes the fp32 scale and its inverse
    (new tensors: the ones the current gradients were made with stay as they were). ``pending`` counts the updates
    applied on the device since the host last read it.
    """

    def __init__(self) -> None:
        self.tensor: Optional[Tensor] = None
        self.scale: Optional[Tensor] = None  # the fp32 scale after the latest update on the device
        self.inverse: Optional[Tensor] = None  # and its reciprocal, the one unscaling multiplies by
        self.pending = 0
        self._due = 0
        self._rules: Optional[Rules] = None

    def due(self, state: ScalerState, rules: Rules) -> int:
        """The pending count at which the next update must be decided on the host, computed from the host's
        ``state`` (exact when nothing is pending) by :func:`~lightning_mp.scaler.rules.steps_before_an_error_may_be_due`."""
        if not self.pending:
            self._due = scaler_rules.steps_before_an_error_may_be_due(state, rules)
        return self._due

    def _build(self, state: ScalerState, device: torch.device, rules: Rules) -> None:
        """The state, the table and the buffers the three ops write, on ``device``, from the host's ``state``."""
        counters = [getattr(state, name) for name in scaler_rules.COUNTERS]
        self.tensor = device_state([*counters, 0.0] + edges(state, rules), device)
        self._table = transition_table(rules).to(device, non_blocking=True)
        self._edges = self.tensor[GROW_EDGE:]
        self._cases: dict[torch.Size, Tensor] = {}  # the case, shaped as the flag (0-dim from unscale_)
        self._map = torch.empty(1, 2 * SLOTS, dtype=torch.float64, device=device)
        self._multipliers, self._addends = self._map[0, :SLOTS], self._map[0, SLOTS:]
        self._scale64 = self.tensor[SCALE]
        self._rules = rules

    def update(
        self, found_inf: Tensor, state: ScalerState, rules: Rules
    ) -> tuple[ScalerState, Optional[tuple[Tensor, Tensor]]]:
        """Apply one step of ``rules`` on ``found_inf``'s device (``> 0``: non-finite; the state is built there from
        the host's ``state`` when it lives elsewhere, was forgotten, or the rules changed: after reading the pending
        updates). Returns the host's state (read back when it had to be rebuilt; else ``state`` itself) and a dynamic
        scaler's new fp32 scale and its inverse (0-dim tensors)."""
        device = found_inf.device
        if self.tensor is None or self.tensor.device != device or rules != self._rules:
            if self.pending:  # the gradients moved to another device, or the rules changed: read the state first
                state, _ = self.pull(state)
            self._build(state, device, rules)
        assert self.tensor is not None
        case = self._cases.get(found_inf.shape)
        if case is None:
            if found_inf.numel() != 1:
                raise ValueError(f"found_inf must hold one value (what unscale_ returns), got shape {found_inf.shape}.")
            case = self._cases[found_inf.shape] = torch.zeros(found_inf.shape, dtype=torch.int64, device=device)
        torch.bucketize(found_inf, self._edges, out=case)
        torch.index_select(self._table, 0, case, out=self._map)
        torch.addcmul(self._addends, self.tensor, self._multipliers, out=self.tensor)
        self.pending += 1
        if not rules.dynamic:
            return state, None
        self.scale = self._scale64.to(torch.float32)  # new tensors: those the gradients were made with stay
        self.inverse = torch.reciprocal(self.scale)
        return state, (self.scale, self.inverse)

    def read(self, found_inf: Optional[Tensor] = None) -> tuple[list[float], Optional[float]]:
        """The state vector (and ``found_inf``'s value, when given) in one transfer to the host: a synchronisation."""
        assert self.tensor is not None
        if found_inf is None:
            values, found = self.tensor.tolist(), None
        else:
            flag = found_inf.reshape(-1)[:1].to(self.tensor.device, torch.float64)
            *values, found = torch.cat([self.tensor, flag]).tolist()
        self.pending = 0
        return values, found

    def pull(self, state: ScalerState, found_inf: Optional[Tensor] = None) -> tuple[ScalerState, Optional[float]]:
        """The host's ``state`` brought up to date (and ``found_inf`` read, when given) in one transfer: a
        synchronisation. Returns the new state (``steps``, counted on the host, as in ``state``) and ``found_inf``'s
        value (``None`` without one)."""
        values, found = self.read(found_inf)
        counters = {name: int(values[_SLOT_OF[name]]) for name in scaler_rules.COUNTERS[1:]}
        return replace(state, scale=values[SCALE], **counters), found

    def forget(self) -> None:
        """The host's copy is ahead (a host update, a loaded state): drop the device copy (nothing may be pending)."""
        self.tensor, self.scale, self.inverse, self.pending, self._rules = None, None, None, 0, None
