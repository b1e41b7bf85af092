"""The optimizer step without waiting for the device: the loss scaler's rules as tensor ops, and the skip of a
non-finite step done by the optimizer on the device.

A step's found-inf flag is a device tensor. Nothing here reads it where that can be avoided:

- :class:`DeviceState` holds a :class:`~lightning_mp.DynamicLossScaler`'s state as one float64 vector on the
  gradients' device and applies the scaler's rules there (:func:`update_on_device`); the host reads it lazily.
- :func:`skips_on_device` says how an optimizer can skip a step on the device: a masters object with
  ``fused_step(optimizer, found_inf)``, or an optimizer that declares ``_step_supports_amp_scaling`` (torch's
  ``fused=True`` Adam, AdamW, SGD and Adagrad; the protocol of ``torch.amp.GradScaler``), which takes the flag as
  its ``found_inf`` attribute and skips in its kernel, step count included.
- :func:`step` is the plugin's optimizer step after the gradients are unscaled and checked. It reads the flag on the
  host (one synchronisation, together with the scaler's pending state) only where the decision is needed there:

  * the optimizer cannot skip on the device (any optimizer without ``fused=True``: an exact skip of, say, the
    for-loop AdamW would need a copy of the parameters and the optimizer state before each step and a
    ``torch.where`` after it, measured at +36% of AdamW's step time for a small MLP and +35% for a large one on
    CPU, and one more copy of the whole state in memory: more than the one read it saves);
  * a scheduler with ``interval="step"`` is guarded on this optimizer (it must not advance on a skipped step, and
    it is stepped on the host right after the optimizer);
  * a skip observer is registered (``PrecisionMonitor(localise_overflows=True)`` replays the skipped step while
    its batch, gradients and parameters are those of that step);
  * the flag lives on the CPU (CPU training): there is no device to wait for, reading it is a memory read, and
    the small tensor ops of the device path cost far more host time than the branch they replace (measured on a
    2-core AVX2 EPYC, torch 2.13 CPU: reading the flag and applying the rules on the host takes 1 us a step; the
    rules on the device 175 us for a check-only scaler, 740 us for a dynamic one, 20-60 us per tiny op; see
    benchmarks/HISTORY.md, 2026-11-25). :data:`DECIDE_CPU_FLAGS_ON_HOST` turns this off (the tests do, to run the
    accelerators' path on CPU tensors).

On an accelerator the device path launches about 9 small kernels a step for a check-only or static scaler and about
30 for a dynamic one (plus the 0/1 flag's two): host launch time, traded for the synchronisation it removes; one
fused kernel would cut it (not done).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from lightning_mp.schedulers import has_step_scheduler, record_step

if TYPE_CHECKING:
    from lightning_mp.scaler import DynamicLossScaler

#: Positions in the scaler's device state, one float64 vector (float64 so that the scale is the exact product the
#: rules state in Python floats, and the counters are exact integers up to 2**53).
SCALE, GROWTH, HYSTERESIS, SKIPPED, CONSECUTIVE, LAST_FOUND = range(6)


def device_state(values: list[float], device: torch.device) -> torch.Tensor:
    """``values`` (in the order above) as the float64 state vector on ``device``, without waiting for it."""
    return torch.tensor(values, dtype=torch.float64).to(device, non_blocking=True)


def update_on_device(
    state: torch.Tensor,
    constants: torch.Tensor,
    found_inf: torch.Tensor,
    dynamic: bool,
    growth_interval: int,
    hysteresis: int,
    max_scale: float,
    restore_hysteresis: bool,
) -> None:
    """One step of the scaler's rules as tensor ops on ``state`` (in place, no host synchronisation).

    ``constants`` is ``[growth_factor, backoff_factor, 1.0]`` (float64, on the state's device). ``found_inf`` is the
    step's flag (``> 0``: non-finite). The rules are those of ``DynamicLossScaler.update`` except the two errors:
    the caller decides the steps where an error may be due on the host (see ``steps_before_an_error_may_be_due``),
    so this function never meets a backoff below ``min_scale`` nor ``max_consecutive_skips``.
    ``restore_hysteresis``: a static scaler whose hysteresis tracker is below ``hysteresis`` (possible only after
    ``load_state_dict``) restores it on a finite step, as the host rules do.
    """
    found = found_inf.reshape(()) > 0
    flag = found.to(torch.float64)
    state[SKIPPED:LAST_FOUND].add_(flag)  # skipped += flag, consecutive += flag
    state[CONSECUTIVE].mul_(flag)  # ... and back to 0 after a finite step
    state[LAST_FOUND].copy_(flag)
    if not dynamic:
        if restore_hysteresis:
            state[HYSTERESIS].copy_(torch.where(found, state[HYSTERESIS], float(hysteresis)))
        return
    growth = state[GROWTH].add_(1.0).mul_(1.0 - flag)  # finite steps in a row
    grow = growth >= growth_interval
    growth.sub_(grow.to(torch.float64) * growth_interval)  # back to 0 when it grows
    allowance = torch.where(found, (state[HYSTERESIS] - 1.0).clamp_(min=0.0), float(hysteresis))
    state[HYSTERESIS].copy_(allowance)
    backoff = found & (allowance == 0.0)
    factor = torch.where(grow, constants[0], torch.where(backoff, constants[1], constants[2]))
    state[SCALE].mul_(factor).clamp_(max=max_scale)


def steps_before_an_error_may_be_due(
    scale: float,
    hysteresis_tracker: int,
    consecutive_skips: int,
    dynamic: bool,
    backoff_factor: float,
    min_scale: float,
    max_consecutive_skips: Optional[int],
    limit: int = 1000,
) -> int:
    """From a known state, the number of the first step (1 = the next one) at which ``DynamicLossScaler.update``
    could raise: ``max_consecutive_skips`` reached, or a backoff below ``min_scale``. Every step before it is safe
    to update on the device; that step is decided on the host. At most ``limit`` (deciding earlier is always safe).

    The fastest way to either error is a run of non-finite steps: a finite step resets the run, restores the
    hysteresis allowance and may grow the scale, which only moves the errors further away.
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
    return due


class DeviceState:
    """A loss scaler's state as one float64 vector on the device, updated there; read by the host lazily.

    ``pending`` counts the updates applied on the device since the host last read it.
    """

    def __init__(self) -> None:
        self.tensor: Optional[Tensor] = None
        self.constants: Optional[Tensor] = None
        self.scale: Optional[Tensor] = None  # the fp32 scale after the latest update on the device
        self.pending = 0
        self._due = 0
        self._ones: dict[torch.device, Tensor] = {}

    def due(self, scaler: DynamicLossScaler) -> int:
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
            )
        return self._due

    def update(self, found_inf: Tensor, scaler: DynamicLossScaler) -> Optional[Tensor]:
        """Apply one step of ``scaler``'s rules on ``found_inf``'s device (the state is built there from the host's
        copy when it lives elsewhere or was forgotten). Returns the new fp32 scale tensor of a dynamic scaler."""
        device = found_inf.device
        if self.tensor is None or self.tensor.device != device:
            if self.pending:  # the gradients moved to another device: read the state there first
                scaler._read()
            self.tensor = device_state(
                [
                    scaler._scale_value,
                    scaler._growth_tracker,
                    scaler._hysteresis_tracker,
                    scaler._skipped_steps,
                    scaler._consecutive_skips,
                    0.0,
                ],
                device,
            )
            self.constants = device_state([scaler.growth_factor, scaler.backoff_factor, 1.0], device)
        assert self.constants is not None
        update_on_device(
            self.tensor,
            self.constants,
            found_inf,
            dynamic=scaler.dynamic,
            growth_interval=scaler.growth_interval,
            hysteresis=scaler.hysteresis,
            max_scale=scaler.max_scale,
            restore_hysteresis=scaler._hysteresis_tracker != scaler.hysteresis,
        )
        self.pending += 1
        if scaler.dynamic:  # a new tensor: the scale the current gradients were made with stays as it was
            self.scale = self.tensor[SCALE].to(torch.float32)
        return self.scale

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

    def one(self, device: torch.device) -> Tensor:
        """A 1-element fp32 ``1.0`` on ``device`` (what a check-only scaler divides by), made once."""
        if device not in self._ones:
            self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return self._ones[device]

    def forget(self) -> None:
        """The host's copy is ahead (a host update, a loaded state): drop the device copy (nothing may be pending)."""
        self.tensor, self.scale, self.pending = None, None, 0


# ------------------------------------------------------------------------------------------ the plugin's step
#: Decide on the host when the found-inf flag is a CPU tensor (no device to wait for; see the module docstring).
DECIDE_CPU_FLAGS_ON_HOST = True


def skips_on_device(optimizer: Any, masters: Any = None) -> bool:
    """Whether a step of ``optimizer`` (a torch optimizer) can be skipped on the device by a found-inf flag: the
    masters' ``fused_step`` takes it, or the optimizer follows ``torch.amp.GradScaler``'s attribute protocol: it
    declares ``_step_supports_amp_scaling`` (torch's ``fused=True`` optimizers) and its ``step`` has no
    ``grad_scaler`` argument (the deprecated protocol, where the optimizer would expect a torch ``GradScaler``)."""
    if callable(getattr(masters, "fused_step", None)):
        return True
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    honours = _HONOURS_FOUND_INF.get(type(optimizer))
    if honours is None:
        try:
            honours = "grad_scaler" not in inspect.signature(optimizer.step).parameters
        except (TypeError, ValueError):  # no signature to read: decide on the host
            honours = False
        _HONOURS_FOUND_INF[type(optimizer)] = honours
    return honours


_HONOURS_FOUND_INF: dict[type, bool] = {}


def step(plugin: Any, optimizer: Any, model: Any, found_inf: Tensor, kwargs: dict[str, Any]) -> Any:
    """The plugin's optimizer step once the gradients are unscaled and checked: ``found_inf`` is the flag every rank
    agreed on. Skipped on the device where the optimizer can and nothing needs the decision on the host (see the
    module docstring); otherwise the flag is read here, once, with the scaler's state. Then the scaler updates."""
    scaler: DynamicLossScaler = plugin.scaler
    torch_optimizer = getattr(optimizer, "_optimizer", optimizer)
    observers = plugin.skip_observers
    on_host = observers or (DECIDE_CPU_FLAGS_ON_HOST and found_inf.device.type == "cpu")
    if not on_host and skips_on_device(torch_optimizer, plugin.masters) and not has_step_scheduler(torch_optimizer):
        flag = (found_inf.reshape(()) > 0).to(torch.float32)  # 0-dim, exactly 0 or 1, as the fused kernels expect
        record_step(torch_optimizer, flag)
        output = _step(plugin.masters, optimizer, torch_optimizer, flag, kwargs)
        scaler.update(found_inf)
        return output
    skip = scaler.read_found_inf(found_inf)  # the step's one host synchronisation
    record_step(torch_optimizer, skip)
    output = None if skip else _step(plugin.masters, optimizer, torch_optimizer, None, kwargs)
    for observer in observers if skip else ():  # the diagnostics extension point (MixedPrecisionPlugin.__init__)
        observer(plugin=plugin, optimizer=torch_optimizer, model=model)
    scaler.update(skip)
    return output


def _step(masters: Any, optimizer: Any, torch_optimizer: Any, flag: Optional[Tensor], kwargs: dict[str, Any]) -> Any:
    """Step ``optimizer``, skipped on the device where ``flag`` (0/1) is 1; ``flag=None``: step."""
    fused_step = getattr(masters, "fused_step", None)
    if callable(fused_step):  # masters that update themselves (and the model's weights)
        return fused_step(torch_optimizer, flag)
    if flag is None:
        output = optimizer.step(**kwargs)
    else:  # torch.amp.GradScaler's protocol: gradients already unscaled (grad_scale None), skip where found_inf is 1
        torch_optimizer.grad_scale, torch_optimizer.found_inf = None, flag
        try:
            output = optimizer.step(**kwargs)
        finally:
            del torch_optimizer.grad_scale, torch_optimizer.found_inf
    if masters is not None:  # flat fp32 masters: a skipped step copies back the unchanged values
        masters.masters_to_model(torch_optimizer)
    return output
