"""Dynamic loss scaling, independent of any trainer.

``DynamicLossScaler`` multiplies the loss by a scale before backward so that small fp16 gradients do not
flush to zero, divides the gradients by the same scale afterwards, and adapts the scale: it grows after a
run of finite steps and backs off when a step produced inf/NaN gradients (that step is skipped by the
caller).

The whole state lives on the gradients' device and nothing in a step waits for it: :meth:`~DynamicLossScaler.unscale_`
returns the found-inf flag as a device tensor, and :meth:`~DynamicLossScaler.update` given that tensor applies the
rules as tensor ops; the host reads the state lazily, in one transfer, when a property or ``state_dict()`` asks and on
the steps where an error may be due, so that errors fire at the step they are due (:mod:`lightning_mp.scaler.device`).
The scaler owns its counters as one :class:`~lightning_mp.scaler.rules.ScalerState`; the rules that move them are
written once, in :mod:`lightning_mp.scaler.rules`. When each part runs in an optimizer step is
:mod:`lightning_mp.stepping`'s decision, not the scaler's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Union, overload

import torch
from torch import Tensor

from lightning_mp.grads import (
    Checked,
    GradientGroups,
    NamedOrPlainParams,
    non_finite_check_and_unscale_,
    nonfinite_names,
)
from lightning_mp.scaler import rules
from lightning_mp.scaler import settings as checks
from lightning_mp.scaler.device import DeviceState
from lightning_mp.scaler.rules import BACKOFF, GROW, Rules, ScalerState
from lightning_mp.scaler.settings import COUNTER_NAMES, FP32_MAX, SETTING_NAMES


class _MakeCheckOnly(Protocol):
    def __call__(self, max_consecutive_skips: Optional[int] = 100) -> DynamicLossScaler: ...


class _ConstructorOrFlag:
    """``check_only``, one name for two things: on the class the constructor ``DynamicLossScaler.check_only(...)``
    (a classmethod), on a scaler its bool attribute (whether it only checks). The attribute, set in ``__init__``,
    lives in the scaler's ``__dict__`` and wins over this (non-data) descriptor, as it did over a classmethod; the
    descriptor only gives both uses their type."""

    def __init__(self, constructor: Callable[..., DynamicLossScaler]) -> None:
        self._constructor = classmethod(constructor)
        self.__doc__ = constructor.__doc__

    @overload
    def __get__(self, instance: None, owner: type[DynamicLossScaler]) -> _MakeCheckOnly: ...

    @overload
    def __get__(self, instance: DynamicLossScaler, owner: Optional[type] = None) -> bool: ...

    def __get__(self, instance: Optional[DynamicLossScaler], owner: Optional[type] = None) -> Any:
        if instance is None:
            return self._constructor.__get__(None, owner)
        return False  # (never reached: every scaler sets the attribute)


def _check_only(cls: type[DynamicLossScaler], max_consecutive_skips: Optional[int] = 100) -> DynamicLossScaler:
    """No scaling (scale 1), only the inf/NaN check, on the device as fp16's: what bf16 uses to skip bad steps."""
    scaler = cls.static(1.0, max_consecutive_skips=max_consecutive_skips)
    scaler.check_only = True
    return scaler


class DynamicLossScaler:
    """Loss scaler with growth, backoff, hysteresis and a minimum scale that fails loudly.

    Args:
        init_scale: the first scale (default ``2.0**16``). Must lie in ``[min_scale, max_scale]``.
        growth_factor: multiplies the scale after ``growth_interval`` consecutive finite steps
            (default ``2.0``, must be ``> 1``).
        backoff_factor: multiplies the scale when a step is non-finite and hysteresis is used up
            (default ``0.5``, must be in ``(0, 1)``).
        growth_interval: number of consecutive finite optimizer steps before the scale grows (default ``2000``).
        hysteresis: number of non-finite steps tolerated before a backoff (default ``1``: back off on every
            non-finite step). The allowance is restored after any finite step.
        min_scale: the scale never goes below this (default ``1.0``). A backoff that would cross it raises
            :class:`FloatingPointError` naming the parameters whose gradients were non-finite: at that point
            the gradients overflow without any scaling and training is diverging.
        max_scale: growth is capped here (default ``2.0**24``; at most the largest fp32, about ``3.4e38``).
        enabled: ``False`` makes every method a no-op: no scaling and no inf/NaN check.
        max_consecutive_skips: a run of this many non-finite optimizer steps in a row raises
            :class:`FloatingPointError` naming the parameters (default ``100``; ``None`` for no limit). It is what
            stops a static scale (or a check-only scaler, see :meth:`check_only`) from skipping forever.

    Every count is in optimizer steps: with several optimizers in manual optimization, each ``opt.step()``
    is one step for the scaler.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        enabled: bool = True,
        max_consecutive_skips: Optional[int] = 100,
    ) -> None:
        settings = checks.validated_settings(
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            enabled=enabled,
            max_consecutive_skips=max_consecutive_skips,
        )
        self.growth_factor: float = settings["growth_factor"]
        self.backoff_factor: float = settings["backoff_factor"]
        self.growth_interval: int = settings["growth_interval"]
        self.hysteresis: int = settings["hysteresis"]
        self.min_scale: float = settings["min_scale"]
        self.max_scale: float = settings["max_scale"]
        self.enabled: bool = settings["enabled"]
        self.max_consecutive_skips: Optional[int] = settings["max_consecutive_skips"]
        self.dynamic = True
        self.check_only = False
        # the counters: the host's copy, exact as of the last read; updates on the device since then live in _device
        self._state = ScalerState(scale=settings["init_scale"], hysteresis_tracker=self.hysteresis)
        self._device = DeviceState()
        self._ones: dict[torch.device, Tensor] = {}  # what a check-only scaler divides by, 1.0 per device
        self._scale_tensor: Optional[Tensor] = None
        # (a scale tensor, its reciprocal): unscaling multiplies by the inverse of the scale the gradients carry; the
        # device update makes both, the host path computes it once per scale tensor
        self._inverse: Optional[tuple[Tensor, Tensor]] = None
        # the scale the current gradients were produced with: unscaling uses it, so an update between two
        # optimizers' steps (manual optimization) cannot unscale the second one's gradients with the new scale
        self._scale_in_grads: Optional[Tensor] = None
        # gradients checked by the last `unscale_`, kept until `update` to name the non-finite ones on error
        self._last_unscaled: Checked = []
        #: ``gather_names(local_names) -> names`` from every rank, for the error at ``min_scale``; under a distributed
        #: strategy the plugin sets it to a collective (all ranks raise together, their decisions being agreed)
        self.gather_names: Callable[[list[str]], list[str]] = list

    @classmethod
    def static(cls, scale: float, max_consecutive_skips: Optional[int] = 100) -> DynamicLossScaler:
        """A scaler whose scale never changes; non-finite steps are still reported (and skipped by the caller),
        and ``max_consecutive_skips`` of them in a row raise."""
        checks.check_number("scale", scale, low=0.0, high=FP32_MAX)
        scaler = cls(
            init_scale=scale,
            min_scale=min(1.0, scale),
            max_scale=max(2.0**24, scale),
            max_consecutive_skips=max_consecutive_skips,
        )
        scaler.dynamic = False
        return scaler

    #: ``DynamicLossScaler.check_only(max_consecutive_skips=100)``: no scaling (scale 1), only the inf/NaN check, on
    #: the device as fp16's: what bf16 uses to skip bad steps. On a scaler: whether it is such a one.
    check_only = _ConstructorOrFlag(_check_only)

    @classmethod
    def for_precision(cls, precision: str, scaler: Any) -> Optional[DynamicLossScaler]:
        """What ``MixedPrecisionPlugin(precision, scaler=...)`` means: a scaler (or ``None`` for no check); see
        :func:`lightning_mp.scaler.settings.scaler_for_precision` for each accepted form per precision."""
        return checks.scaler_for_precision(cls, precision, scaler)

    # ------------------------------------------------------------------ read-only state
    @property
    def scale(self) -> float:
        """The current loss scale (a Python float). A dynamic scaler reads its state when updates on the device are
        pending (one host synchronisation for the whole state); a static or check-only one never does."""
        return self._read(self.dynamic).scale if self.enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """Total optimizer steps reported as non-finite to :meth:`update` (the steps the caller skipped). Reads the
        state when updates on the device are pending (one host synchronisation)."""
        return self._read().skipped_steps

    @property
    def consecutive_skips(self) -> int:
        """Non-finite optimizer steps in a row, up to the latest one (0 after a finite step). Reads the state when
        updates on the device are pending (one host synchronisation)."""
        return self._read().consecutive_skips

    @property
    def steps(self) -> int:
        """Total optimizer steps seen by :meth:`update`, finite or not (known on the host: never synchronises)."""
        return self._state.steps

    @property
    def pending_updates(self) -> int:
        """Updates applied on the device that the host has not read yet (0 right after any read)."""
        return self._device.pending

    def get_scale(self) -> float:
        """Alias of :attr:`scale`, the name ``torch.amp.GradScaler`` uses."""
        return self.scale

    # ------------------------------------------------------------------ per step
    def scale_loss(self, loss: Tensor) -> Tensor:
        """Return ``loss * scale`` (``loss`` unchanged when disabled or check-only)."""
        if not self.enabled or self.check_only:
            return loss
        if self._scale_tensor is None:
            self._scale_tensor = torch.full((), self._state.scale, dtype=torch.float32, device=loss.device)
        elif self._scale_tensor.device != loss.device:  # (the host's copy of the scale may be behind: move it)
            self._scale_tensor = self._scale_tensor.to(loss.device)
        self._scale_in_grads = self._scale_tensor
        # the scale is fp32: a 0-dim fp16 loss is promoted to fp32 and cannot overflow here
        return loss * self._scale_tensor

    def scale_of_grads(self, device: Optional[torch.device] = None) -> Tensor:
        """The scale the current gradients carry: the one of the latest :meth:`scale_loss` (a 0-dim fp32 tensor),
        or, without one, the current scale (made on ``device``)."""
        current = self._scale_in_grads if self._scale_in_grads is not None else self._scale_tensor
        if current is None or not self.enabled or self.check_only:
            return torch.full((), self._state.scale if self.enabled else 1.0, dtype=torch.float32, device=device)
        return current if device is None or self._scale_in_grads is not None else current.to(device)

    def unscale_(self, params: Union[NamedOrPlainParams, GradientGroups]) -> Tensor:
        """Divide the ``.grad`` of ``params`` by the scale in place and check them for inf/NaN.

        Accepts fp32, fp16 and bf16 gradients (dense or sparse), on any mix of devices. ``params`` holds tensors or
        ``(name, tensor)`` pairs (names for the errors of :meth:`update`), or is a
        :class:`~lightning_mp.grads.GradientGroups` of them, built once by a caller that checks the same
        parameters every step. Returns a 0-dim fp32 tensor on the device of the first gradient, exactly 1.0 if a
        non-finite gradient was found and 0.0 if not (the form torch's fused optimizers take as ``found_inf``); it
        does not synchronise.

        Sharded (``DTensor``) gradients are unscaled and checked through their local shards: no collective and no
        DTensor dispatch happen here, so the flag is this rank's; a caller on several ranks sums it over them before
        deciding (``lightning_mp.distributed``; the plugin does).
        """
        groups = params if isinstance(params, GradientGroups) else GradientGroups(params)
        self._last_unscaled = []
        if not self.enabled:
            return torch.zeros((), dtype=torch.float32, device=groups.first_gradient_device())
        grad_enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() without its Python frames, at every step
        try:
            per_device = groups.gradients()
            if not per_device:
                return torch.zeros((), dtype=torch.float32)
            first_device = per_device[0][0]
            scale = None if self.check_only else self.scale_of_grads(first_device)  # without scale_loss: current
            flags = []
            for device, per_dtype in per_device:
                if scale is None:  # check-only: divided by one (made once per device)
                    inv_scale = self._ones.get(device)
                    if inv_scale is None:
                        inv_scale = self._ones[device] = torch.ones((), dtype=torch.float32, device=device)
                else:
                    inv_scale = self._inverse_of(scale, device)
                found_inf = torch.zeros((), dtype=torch.float32, device=device)
                for _, grads in per_dtype:  # bf16 on CUDA too; a check-only step reads without writing back
                    non_finite_check_and_unscale_(grads, found_inf, inv_scale, check_only=scale is None)
                flags.append(found_inf if device == first_device else found_inf.to(first_device))
            self._last_unscaled = per_device
        finally:
            torch._C._set_grad_enabled(grad_enabled)
        return flags[0] if len(flags) == 1 else torch.stack(flags).amax(0)  # still exactly 0 or 1

    def _inverse_of(self, scale: Tensor, device: torch.device) -> Tensor:
        """The reciprocal of ``scale`` on ``device`` (fp32, as torch's kernel computes it), made once per scale."""
        if device != scale.device:
            return scale.to(device).reciprocal()
        if self._inverse is None or self._inverse[0] is not scale:
            self._inverse = (scale, torch.reciprocal(scale))
        return self._inverse[1]

    @staticmethod
    def found_inf(found_inf: Tensor) -> bool:
        """Read the flag returned by :meth:`unscale_` (one host synchronisation)."""
        return bool(found_inf.item() > 0)

    def read_found_inf(self, found_inf: Tensor) -> bool:
        """Read the flag returned by :meth:`unscale_` and, in the same transfer, the state updated on the device
        since the last read (one host synchronisation in all)."""
        if not self._device.pending:
            return bool(found_inf.item() > 0)
        self._state, found = self._device.pull(self._state, found_inf)
        return found is not None and found > 0  # (found_inf given: its value, never None)

    def update(self, found_inf: Union[bool, Tensor]) -> None:
        """Adapt the scale after an optimizer step.

        ``found_inf``: the tensor returned by :meth:`unscale_`, or its sum over ranks (``> 0``: non-finite; the rules
        run on the device, with no synchronisation but on a step where an error or the ``max_scale`` cap may be due),
        or a bool (the flag already read: the rules run on the host). A
        finite step restores the hysteresis allowance and, after ``growth_interval`` of them in a row, multiplies the
        scale by ``growth_factor`` (capped at ``max_scale``). A non-finite step resets the growth count and uses one
        unit of hysteresis; once it is used up, the scale is multiplied by ``backoff_factor``.

        Raises:
            FloatingPointError: the backoff would take the scale below ``min_scale``, or ``max_consecutive_skips``
                non-finite steps in a row were reached; raised at the step where it happens, in both cases.
        """
        if not self.enabled:
            return
        try:  # the gradients checked by the last `unscale_` are kept until here, to name the non-finite ones
            if isinstance(found_inf, Tensor):
                settings = self._rules()
                if self._device.pending + 1 < self._device.due(self._state, settings):
                    self._state, made = self._device.update(found_inf, self._state, settings)
                    if made is not None:  # a dynamic scaler's new scale and its inverse
                        self._scale_tensor, self._inverse = made[0], made
                    self._state.steps += 1
                    return
                found_inf = self.read_found_inf(found_inf)  # an error may be due at this step: decide it here
            self._update_on_host(found_inf)
        finally:
            self._last_unscaled = []

    def _update_on_host(self, found_inf: bool) -> None:
        state = self._read()
        if self._device.tensor is not None:  # the host's copy is ahead from here on; the device's is made again
            self._device.forget()
        step = rules.update(state, found_inf, self._rules())
        self._state = step.state
        if step.error is not None:
            self._raise(step.error)
        if step.case in (GROW, BACKOFF):  # a new scale tensor (at the cap too, as the value may not change)
            self._set_scale(self._state.scale)

    def _rules(self) -> Rules:
        """The settings the rules read, as they are now (:mod:`lightning_mp.scaler.rules`)."""
        return Rules(
            self.dynamic,
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.hysteresis,
            self.min_scale,
            self.max_scale,
            self.max_consecutive_skips,
        )

    # ------------------------------------------------------------------ the state on the device
    def _read(self, needed: bool = True) -> ScalerState:
        """The host's copy of the state, brought up to date if updates on the device are pending (one transfer)."""
        if needed and self._device.pending:
            self._state, _ = self._device.pull(self._state)
        return self._state

    def _raise(self, reason: str) -> None:
        raise nonfinite_error(reason, self.gather_names(self.nonfinite_grad_names()))

    def nonfinite_grad_names(self) -> list[str]:
        """Names of the parameters whose gradients, as last unscaled, hold inf or NaN (costs a sync each)."""
        return nonfinite_names(self._last_unscaled)

    def _set_scale(self, value: float) -> None:
        # a new tensor, not an in-place fill: `_scale_in_grads` must keep the scale the grads were made with
        self._state.scale = value
        self._device.forget()
        if self._scale_tensor is not None:
            self._scale_tensor = torch.full((), value, dtype=torch.float32, device=self._scale_tensor.device)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: scale, trackers, counters and the settings. Reads the state when
        updates on the device are pending (one host synchronisation)."""
        state = self._read()
        return {
            "scale": state.scale,
            **{name: getattr(state, name) for name in COUNTER_NAMES},
            **{name: getattr(self, name) for name in SETTING_NAMES},
        }

    def load_state_dict(self, state_dict: dict[str, Any], source: str = "state_dict") -> None:
        """Restore :meth:`state_dict`. The checkpoint's settings replace the constructor's, as in torch.

        Every value is checked with the constructor's rules before anything changes; ``source`` names where the
        state came from (e.g. ``checkpoint['MixedPrecisionPlugin']['scaler']``) in the error.

        Raises:
            KeyError: a required key is missing.
            ValueError: a value is out of range or of the wrong type (the error names the key, the value and
                ``source``).
        """
        settings, counters = checks.validated_state(state_dict, defaults=self.state_dict(), source=source)
        for name in SETTING_NAMES:
            setattr(self, name, settings[name])
        self._state = ScalerState(scale=settings["init_scale"], **counters)
        self._scale_in_grads = None
        self._set_scale(settings["init_scale"])

    def __repr__(self) -> str:
        """How it was made (disabled, check-only, static) or its settings."""
        name = type(self).__name__
        if not self.enabled:
            return f"{name}(enabled=False)"
        if self.check_only:
            return f"{name}.check_only(max_consecutive_skips={self.max_consecutive_skips})"
        if not self.dynamic:
            return f"{name}.static({self._state.scale:g})"
        return (
            f"{name}(scale={self.scale:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale:g}, max_scale={self.max_scale:g})"
        )


def nonfinite_error(reason: str, names: list[str]) -> FloatingPointError:
    """The scaler's error at ``min_scale`` or ``max_consecutive_skips``: ``reason``, then the culprits by name."""
    shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
    return FloatingPointError(
        f"{reason} Non-finite gradients in: {shown or 'unknown parameters (pass (name, param) pairs to unscale_)'}. "
        "Look for an overflow in the forward pass of these parameters' modules (run them in fp32), "
        "a too-large learning rate, or bad input data."
    )
