"""The loss scaler's device side: the gradients it checks, grouped per device and dtype, and its state as one
float64 vector on the device, updated there by its rules as tensor ops, read by the host lazily.

Nothing here decides when a step happens (that is :mod:`lightning_mp.stepping`) nor imports it: this is the
arithmetic of :class:`~lightning_mp.DynamicLossScaler` that runs on the device.

- :class:`GradientGroups`: parameters grouped once by device and dtype (the check kernel takes one device per call and
  runs fastest on one dtype); each step then only reads their ``.grad`` (sparse values, ``DTensor`` local shards).
- :class:`DeviceState` holds a scaler's state as one float64 vector on the gradients' device and applies the scaler's
  rules there in three ops (the flag sorted into a case by :func:`edges` kept in the state, that case's affine map
  from :func:`transition_table`); :func:`steps_before_an_error_may_be_due` says from which step an update must be
  decided on the host, so that errors (and a growth the ``max_scale`` cap clips) happen at the step they are due.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Optional, Union

import torch
from torch import Tensor

# What `DynamicLossScaler.unscale_` accepts: tensors whose ``.grad`` is unscaled, or ``(name, tensor)`` pairs.
NamedOrPlainParams = Iterable[Union[Tensor, tuple[str, Tensor]]]
# What one check saw (`GradientGroups.gradients`): per device, per dtype, the names and the gradients checked.
Checked = list[tuple[torch.device, list[tuple[list[str], list[Tensor]]]]]


#: Positions in the scaler's device state, one float64 vector (float64 so that the scale is the exact product the
#: rules state in Python floats, and the counters are exact integers up to 2**53). The last three are the edges
#: that sort a step's found-inf flag into one of the four cases of the rules (see :func:`edges`).
SCALE, GROWTH, HYSTERESIS, SKIPPED, CONSECUTIVE, LAST_FOUND, GROW_EDGE, MIDDLE, BACKOFF_EDGE = range(9)
SLOTS = 9
#: The cases, in the order ``torch.bucketize(found_inf, edges)`` numbers them: a finite step that grows the scale,
#: one that does not, a non-finite step that keeps the scale (hysteresis left), one that backs off.
GROW, FINITE, SKIP, BACKOFF = range(4)
#: A back-off edge step per unit of hysteresis: larger than any flag (a flag summed over ranks is at most their count)
_STEP = 2.0**20


def device_state(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` (in the order above) as the float64 state vector on ``device``, without waiting for it."""
    return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


def edges(dynamic: bool, growth_tracker: int, hysteresis_tracker: int, growth_interval: int) -> list[float]:
    """The ``GROW_EDGE, MIDDLE, BACKOFF_EDGE`` slots for a state, sorted as ``torch.bucketize`` needs them.

    A finite flag (0) counts the edges below 0: the grow edge ``growth_tracker + 1 - growth_interval`` (at most 0)
    is below 0 exactly when the step does not grow the scale. A non-finite flag (1 or more) counts the edges below
    it: the grow edge and the middle (0.25) always, the back-off edge (0.5 while at most one unit of hysteresis is
    left, ``_STEP`` more per further unit) exactly when the step backs off. A static scaler's edges never move:
    every finite step is case ``FINITE``, every non-finite one ``SKIP``.
    """
    if not dynamic:
        return [-1.0, 0.25, _STEP + 0.5]
    # (a tracker at or past the interval, possible after a load, grows at the next finite step: edge 0)
    return [float(min(growth_tracker + 1 - growth_interval, 0)), 0.25, _backoff_edge(hysteresis_tracker)]


def _backoff_edge(hysteresis_tracker: int) -> float:
    return 0.5 if hysteresis_tracker <= 1 else _STEP * (hysteresis_tracker - 1) + 0.5


def transition_table(
    dynamic: bool, growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int
) -> torch.Tensor:
    """The scaler's rules as one affine map per case: row ``case`` holds the multipliers of every slot, then what is
    added (``new = old * multiplier + addend``, exact: each multiplier is 0, 1 or a factor, each addend an integer
    or a quarter). What the rules leave out here, the host decides: a growth that the ``max_scale`` cap may clip,
    a back-off below ``min_scale``, ``max_consecutive_skips`` (see :func:`steps_before_an_error_may_be_due`)."""
    keep, zero = (1.0, 0.0), (0.0, 0.0)
    rows = [[keep] * SLOTS for _ in range(4)]
    for case in (SKIP, BACKOFF):  # skipped and consecutive count up, the flag is remembered
        rows[case][SKIPPED], rows[case][CONSECUTIVE], rows[case][LAST_FOUND] = (1.0, 1.0), (1.0, 1.0), (0.0, 1.0)
    for case in (GROW, FINITE):  # a finite step ends the run of skips and restores the hysteresis allowance
        rows[case][CONSECUTIVE], rows[case][LAST_FOUND], rows[case][HYSTERESIS] = zero, zero, (0.0, float(hysteresis))
    if dynamic:
        restart = (0.0, float(1 - growth_interval))  # the grow edge of a growth tracker back at 0
        rows[GROW][SCALE], rows[BACKOFF][SCALE] = (growth_factor, 0.0), (backoff_factor, 0.0)
        rows[GROW][GROWTH], rows[SKIP][GROWTH], rows[BACKOFF][GROWTH] = zero, zero, zero
        rows[GROW][GROW_EDGE], rows[SKIP][GROW_EDGE], rows[BACKOFF][GROW_EDGE] = restart, restart, restart
        rows[FINITE][GROWTH], rows[FINITE][GROW_EDGE] = (1.0, 1.0), (1.0, 1.0)
        rows[SKIP][HYSTERESIS], rows[BACKOFF][HYSTERESIS] = (1.0, -1.0), zero  # one unit used; none left
        rows[SKIP][BACKOFF_EDGE], rows[BACKOFF][BACKOFF_EDGE] = (1.0, -_STEP), (0.0, 0.5)
        for case in (GROW, FINITE):
            rows[case][BACKOFF_EDGE] = (0.0, _backoff_edge(hysteresis))
    table = [[pair[0] for pair in row] + [pair[1] for pair in row] for row in rows]
    return torch.tensor(table, dtype=torch.float64)


def steps_before_an_error_may_be_due(
    scale: float,
    hysteresis_tracker: int,
    consecutive_skips: int,
    dynamic: bool,
    backoff_factor: float,
    min_scale: float,
    max_consecutive_skips: Optional[int],
    limit: int = 1000,
    growth_tracker: int = 0,
    growth_interval: int = 1,
    growth_factor: float = 2.0,
    max_scale: float = float("inf"),
) -> int:
    """From a known state, the number of the first step (1 = the next one) at which ``DynamicLossScaler.update``
    could raise (``max_consecutive_skips`` reached, or a backoff below ``min_scale``) or the ``max_scale`` cap could
    clip a growth. Every step before it is safe to update on the device; that step is decided on the host. At most
    ``limit`` (deciding earlier is always safe).

    The fastest way to either error is a run of non-finite steps: a finite step resets the run, restores the
    hysteresis allowance and may grow the scale, which only moves the errors further away. The fastest way to the
    cap is a run of finite steps: one growth every ``growth_interval`` of them (the first after
    ``growth_interval - growth_tracker``); a back-off only moves it away (the margin covers the roundings of a
    back-off and a growth that do not cancel exactly, over ``limit`` steps).
    """
    due = limit
    if max_consecutive_skips is not None:
        due = min(due, max(max_consecutive_skips - consecutive_skips, 1))
    if dynamic:
        backoffs, value = 0, scale
        while value * backoff_factor >= min_scale and backoffs < limit:
            value *= backoff_factor
            backoffs += 1
        due = min(due, max(hysteresis_tracker, 1) + backoffs)  # the first backoff, then one per non-finite step
        growths, value = 0, scale
        while value * growth_factor * (1.0 + 2.0**-40) <= max_scale and growths < limit:
            value *= growth_factor
            growths += 1
        due = min(due, max(growth_interval - growth_tracker, 1) + growths * growth_interval)
    return due


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
        self._rules: Optional[tuple[Any, ...]] = None
        self._ones: dict[torch.device, Tensor] = {}

    def due(self, scaler: Any) -> int:
        """The pending count at which the next update must be decided on the host, computed from the host's copy of
        ``scaler``'s state (exact when nothing is pending) by :func:`steps_before_an_error_may_be_due`."""
        if not self.pending:
            self._due = steps_before_an_error_may_be_due(
                scaler._scale_value,
                scaler._hysteresis_tracker,
                scaler._consecutive_skips,
                scaler.dynamic,
                scaler.backoff_factor,
                scaler.min_scale,
                scaler.max_consecutive_skips,
                growth_tracker=scaler._growth_tracker,
                growth_interval=scaler.growth_interval,
                growth_factor=scaler.growth_factor,
                max_scale=scaler.max_scale,
            )
        return self._due

    def _build(self, scaler: Any, device: torch.device, rules: tuple[Any, ...]) -> None:
        """The state, the table and the buffers the three ops write, on ``device``, from the host's copy."""
        if self.pending:  # the gradients moved to another device, or the rules changed: read the state first
            self.pull(scaler)
        counters = [scaler._growth_tracker, scaler._hysteresis_tracker, scaler._skipped_steps]
        self.tensor = device_state(
            [scaler._scale_value, *counters, scaler._consecutive_skips, 0.0]
            + edges(scaler.dynamic, scaler._growth_tracker, scaler._hysteresis_tracker, scaler.growth_interval),
            device,
        )
        self._table = transition_table(*rules).to(device, non_blocking=True)
        self._edges = self.tensor[GROW_EDGE:]
        self._cases: dict[torch.Size, Tensor] = {}  # the case, shaped as the flag (0-dim from unscale_)
        self._map = torch.empty(1, 2 * SLOTS, dtype=torch.float64, device=device)
        self._multipliers, self._addends = self._map[0, :SLOTS], self._map[0, SLOTS:]
        self._scale64 = self.tensor[SCALE]
        self._rules = rules

    def update(self, found_inf: Tensor, scaler: Any) -> Optional[tuple[Tensor, Tensor]]:
        """Apply one step of ``scaler``'s rules on ``found_inf``'s device (``> 0``: non-finite; the state is built
        there from the host's copy when it lives elsewhere or was forgotten). Returns a dynamic scaler's new fp32
        scale and its inverse (0-dim tensors)."""
        device = found_inf.device
        rules = (scaler.dynamic, scaler.growth_factor, scaler.backoff_factor, scaler.growth_interval, scaler.hysteresis)
        if self.tensor is None or self.tensor.device != device or rules != self._rules:
            self._build(scaler, device, rules)
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
        if not scaler.dynamic:
            return None
        self.scale = self._scale64.to(torch.float32)  # new tensors: those the gradients were made with stay
        self.inverse = torch.reciprocal(self.scale)
        return self.scale, self.inverse

    def read(self, found_inf: Optional[Tensor] = None) -> tuple[list[float], Optional[float]]:
        """The state (and ``found_inf``'s value, when given) in one transfer to the host: a synchronisation."""
        assert self.tensor is not None
        if found_inf is None:
            values, found = self.tensor.tolist(), None
        else:
            flag = found_inf.reshape(-1)[:1].to(self.tensor.device, torch.float64)
            *values, found = torch.cat([self.tensor, flag]).tolist()
        self.pending = 0
        return values, found

    def pull(self, scaler: Any, found_inf: Optional[Tensor] = None) -> Optional[float]:
        """Bring ``scaler``'s host copy of the state up to date (and read ``found_inf``, when given) in one transfer:
        a synchronisation. Returns ``found_inf``'s value (``None`` without one)."""
        values, found = self.read(found_inf)
        scaler._scale_value = values[SCALE]
        scaler._growth_tracker, scaler._hysteresis_tracker = int(values[GROWTH]), int(values[HYSTERESIS])
        scaler._skipped_steps, scaler._consecutive_skips = int(values[SKIPPED]), int(values[CONSECUTIVE])
        return found

    def one(self, device: torch.device) -> Tensor:
        """A 0-dim fp32 ``1.0`` on ``device`` (what a check-only scaler divides by), made once."""
        if device not in self._ones:
            self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
        return self._ones[device]

    def forget(self) -> None:
        """The host's copy is ahead (a host update, a loaded state): drop the device copy (nothing may be pending)."""
        self.tensor, self.scale, self.inverse, self.pending, self._rules = None, None, None, 0, None


# ------------------------------------------------------------------------------------------ the gradients it checks
class GradientGroups:
    """``params`` (tensors, or ``(name, tensor)`` pairs: names for the errors) grouped once by device and dtype.

    The grouping is by the parameters' device and dtype, which are their gradients' (torch refuses a ``.grad`` of
    another device or dtype); a caller that checks the same parameters every step builds it once
    (``lightning_mp.stepping`` does, per optimizer) and :meth:`gradients` then only reads each ``.grad``. Sparse
    gradients are coalesced (duplicate indices are summed: the sums are what may overflow) and their values checked;
    ``DTensor`` gradients through their local shards (same storage: unscaling them unscales the ``DTensor``).
    """

    def __init__(self, params: NamedOrPlainParams) -> None:
        named = [item if isinstance(item, tuple) else (f"<unnamed #{i}>", item) for i, item in enumerate(params)]
        by_device: dict[torch.device, dict[torch.dtype, tuple[list[str], list[Tensor]]]] = {}
        for name, param in named:
            names, group = by_device.setdefault(param.device, {}).setdefault(param.dtype, ([], []))
            names.append(name)
            group.append(param)
        self.groups = [list(per_dtype.values()) for per_dtype in by_device.values()]
        self.named = named
        # subclasses (DTensor) have local shards to take; plain tensors and parameters do not
        self.plain = all(type(param) in (Tensor, torch.nn.Parameter) for _, param in named)

    def first_gradient_device(self) -> Optional[torch.device]:
        """The device of the first parameter (in the order given) that has a gradient; ``None`` if none has."""
        return next((grad.device for _, param in self.named if (grad := param.grad) is not None), None)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        """The ``(name, parameter)`` pairs, in the order given: a ``GradientGroups`` is what it was built from."""
        return iter(self.named)

    def gradients(self) -> Checked:
        """This step's gradients to check: per device (in order of first appearance), per dtype, their names and the
        gradients; parameters without a gradient are left out, and so are devices and dtypes without any."""
        found = []
        for per_dtype in self.groups:
            lists = []
            for names, params in per_dtype:
                grads = [grad for param in params if (grad := param.grad) is not None]
                if len(grads) != len(params):  # some have no gradient (yet): name the others only
                    names = [name for name, param in zip(names, params) if param.grad is not None]
                if not self.plain or True in [grad.is_sparse for grad in grads]:  # (no generator frame per step)
                    grads = [_checked_form(param) for param in params if param.grad is not None]
                if grads:
                    lists.append((names, grads))
            if lists:
                found.append((lists[0][1][0].device, lists))
        return found


def nonfinite_names(checked: Checked) -> list[str]:
    """Names of the gradients in ``checked`` that hold inf or NaN (one host synchronisation each: for errors)."""
    return [
        name
        for _, lists in checked
        for names, grads in lists
        for name, grad in zip(names, grads)
        if not torch.isfinite(grad).all()
    ]


def nonfinite_error(reason: str, names: list[str]) -> FloatingPointError:
    """The scaler's error at ``min_scale`` or ``max_consecutive_skips``: ``reason``, then the culprits by name."""
    shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    return FloatingPointError(
        f"{reason} Non-finite gradients in: {shown or 'unknown parameters (pass (name, param) pairs to unscale_)'}. "
        "Look for an overflow in the forward pass of these parameters' modules (run them in fp32), "
        "a too-large learning rate, or bad input data."
    )


def _checked_form(param: Tensor) -> Tensor:
    """What of ``param.grad`` the kernel checks: a sparse gradient's values, once coalesced; a DTensor's local shard."""
    grad = param.grad
    assert grad is not None
    if grad.is_sparse:
        if not grad.is_coalesced():
            param.grad = grad = grad.coalesce()
        grad = grad._values()
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad


# ------------------------------------------------------------------ the check, for every dtype on every device
# torch's CUDA kernel (_amp_foreach_non_finite_check_and_unscale_) takes fp32 and fp16 gradients but not bf16 ("not
# implemented for 'BFloat16'"), which lean masters (bf16 parameters, bf16 gradients) meet on a GPU. There the check
# is the max-abs norm of each gradient (torch._foreach_norm with ord=inf: one multi-tensor kernel; an inf or NaN
# element makes the norm inf or NaN, and a max cannot overflow), and the unscale one torch._foreach_mul_. A
# check-only step on the CPU reads the gradients without writing them back (torch's kernel multiplies them by one).


#: gradient elements from which a check-only step reads them through the compiled check (below: torch's kernel,
#: whose call costs less than the ctypes call for small models; measured with benchmarks/framework_overhead.py)
_READ_ONLY_FROM = 1 << 20


def non_finite_check_and_unscale_(
    grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor, check_only: bool = False
) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place and set ``found_inf`` (a 1-element fp32
    tensor) to 1 if any element is inf or NaN, as ``torch._amp_foreach_non_finite_check_and_unscale_`` does.
    ``check_only`` (``inv_scale`` is one): on the CPU, read the gradients without writing them back, through the
    compiled check of :mod:`lightning_mp.kernels.native` where it is built."""
    if check_only and grads and grads[0].device.type == "cpu" and sum(g.numel() for g in grads) >= _READ_ONLY_FROM:
        from lightning_mp.kernels import native  # the kernel's module, loaded on first use

        if native.check_nonfinite(grads, found_inf):
            return
    if grads and grads[0].dtype == torch.bfloat16 and grads[0].device.type != "cpu":
        return check_and_unscale_by_norm_(grads, found_inf, None if check_only else inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


def check_and_unscale_by_norm_(grads: list[Tensor], found_inf: Tensor, inv_scale: Optional[Tensor]) -> None:
    """The same through ``torch._foreach_norm(ord=inf)`` and ``torch._foreach_mul_`` (any dtype, any device);
    ``inv_scale=None``: check only (a bf16 step has no scale; multiplying each gradient by one was a kernel launch
    per gradient for nothing, seen in an H100 profile: mixed dtypes take the per-tensor path)."""
    norms = torch._foreach_norm(grads, float("inf"))
    bad = torch.stack(norms).isfinite().logical_not().any()
    found_inf.copy_(torch.maximum(found_inf, bad.to(found_inf.dtype).reshape(found_inf.shape)))
    if inv_scale is not None:
        torch._foreach_mul_(grads, inv_scale.reshape(()))  # computed in fp32, as torch's kernel does
