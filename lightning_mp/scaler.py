"""Dynamic loss scaling, independent of any trainer.

``DynamicLossScaler`` multiplies the loss by a scale before backward so that small fp16 gradients do not
flush to zero, divides the gradients by the same scale afterwards, and adapts the scale: it grows after a
run of finite steps and backs off when a step produced inf/NaN gradients (that step is skipped by the
caller).

The scale lives in a 0-dim fp32 tensor on the gradients' device, so scaling and unscaling never wait for
the device. The only host synchronisation is reading whether a non-finite gradient was found, which the
caller needs anyway to decide whether to step the optimizer: :meth:`DynamicLossScaler.found_inf` does it
once per step and :meth:`DynamicLossScaler.update` takes the resulting Python bool.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, Optional, Union

import torch
from torch import Tensor

# What `unscale_` accepts: tensors whose ``.grad`` is unscaled, or ``(name, tensor)`` pairs so that errors can
# name the parameters.
NamedOrPlainParams = Iterable[Union[Tensor, tuple[str, Tensor]]]


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
        max_scale: growth is capped here (default ``2.0**24``).
        enabled: ``False`` makes every method a no-op (bf16 needs no scaling).

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
    ) -> None:
        _check_positive_finite("init_scale", init_scale)
        _check_positive_finite("min_scale", min_scale)
        _check_positive_finite("max_scale", max_scale)
        if not growth_factor > 1.0 or not math.isfinite(growth_factor):
            raise ValueError(f"growth_factor={growth_factor!r} is not allowed: it must be a finite number > 1.")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor={backoff_factor!r} is not allowed: it must be in the open interval (0, 1).")
        _check_positive_int("growth_interval", growth_interval)
        _check_positive_int("hysteresis", hysteresis)
        if min_scale > max_scale:
            raise ValueError(f"min_scale={min_scale!r} is larger than max_scale={max_scale!r}: it must be <= max_scale.")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale={init_scale!r} is outside [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}]."
            )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.enabled = bool(enabled)
        self.dynamic = True
        self._scale_value = float(init_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._steps = 0
        self._skipped_steps = 0
        # device tensors, created lazily on the loss's device
        self._scale_tensor: Optional[Tensor] = None
        # the scale the current gradients were produced with: unscaling uses it, so an update between two
        # optimizers' steps (manual optimization) cannot unscale the second one's gradients with the new scale
        self._scale_in_grads: Optional[Tensor] = None
        # gradients checked by the last `unscale_`, kept until `update` to name the non-finite ones on error
        self._last_unscaled: list[tuple[str, Tensor]] = []

    @classmethod
    def static(cls, scale: float) -> DynamicLossScaler:
        """A scaler whose scale never changes; non-finite steps are still reported (and skipped by the caller)."""
        _check_positive_finite("scale", scale)
        scaler = cls(init_scale=scale, min_scale=min(1.0, scale), max_scale=max(2.0**24, scale))
        scaler.dynamic = False
        return scaler

    # ------------------------------------------------------------------ read-only state
    @property
    def scale(self) -> float:
        """The current loss scale (a Python float; reading it never synchronises with the device)."""
        return self._scale_value if self.enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """Total optimizer steps reported as non-finite to :meth:`update` (the steps the caller skipped)."""
        return self._skipped_steps

    @property
    def steps(self) -> int:
        """Total optimizer steps seen by :meth:`update`, finite or not."""
        return self._steps

    def get_scale(self) -> float:
        """Alias of :attr:`scale`, the name ``torch.amp.GradScaler`` uses."""
        return self.scale

    # ------------------------------------------------------------------ per step
    def scale_loss(self, loss: Tensor) -> Tensor:
        """Return ``loss * scale`` (``loss`` unchanged when disabled)."""
        if not self.enabled:
            return loss
        if self._scale_tensor is None or self._scale_tensor.device != loss.device:
            self._scale_tensor = torch.full((), self._scale_value, dtype=torch.float32, device=loss.device)
        self._scale_in_grads = self._scale_tensor
        # the scale is fp32: a 0-dim fp16 loss is promoted to fp32 and cannot overflow here
        return loss * self._scale_tensor

    def unscale_(self, params: NamedOrPlainParams) -> Tensor:
        """Divide the ``.grad`` of ``params`` by the scale in place and check them for inf/NaN.

        Accepts fp32, fp16 and bf16 gradients (dense or sparse), on any mix of devices. ``params`` holds
        tensors or ``(name, tensor)`` pairs; names are used in the :class:`FloatingPointError` of
        :meth:`update`. Returns a 1-element fp32 tensor, ``> 0`` if a non-finite gradient was found, on the
        device of the first gradient; it does not synchronise.
        """
        named = [item if isinstance(item, tuple) else (f"<unnamed #{i}>", item) for i, item in enumerate(params)]
        self._last_unscaled = []
        if not self.enabled:
            device = next((p.grad.device for _, p in named if p.grad is not None), None)
            return torch.zeros(1, dtype=torch.float32, device=device)
        first_device = None
        per_device_dtype: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for name, param in named:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    # duplicate indices are summed by coalesce: check the sums, which may overflow
                    if not grad.is_coalesced():
                        param.grad = grad = grad.coalesce()
                    grad = grad._values()
                self._last_unscaled.append((name, grad))
                if first_device is None:
                    first_device = grad.device
                per_device_dtype[grad.device][grad.dtype].append(grad)
            if first_device is None:
                return torch.zeros(1, dtype=torch.float32)
            scale = self._scale_in_grads
            if scale is None:  # unscale_ without scale_loss: the grads carry the current scale
                scale = torch.full((), self._scale_value, dtype=torch.float32, device=first_device)
            found_inf_total = torch.zeros(1, dtype=torch.float32, device=first_device)
            for device, per_dtype in per_device_dtype.items():
                inv_scale = scale.to(device).reciprocal().reshape(1)
                found_inf = torch.zeros(1, dtype=torch.float32, device=device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
                found_inf_total += found_inf.to(first_device)
        return found_inf_total

    @staticmethod
    def found_inf(found_inf: Tensor) -> bool:
        """Read the flag returned by :meth:`unscale_`: the one host synchronisation of a step."""
        return bool(found_inf.item() > 0)

    def update(self, found_inf: Union[bool, Tensor]) -> None:
        """Adapt the scale after an optimizer step.

        ``found_inf`` is whether this step's gradients were non-finite (a bool, or the tensor returned by
        :meth:`unscale_`, which costs one synchronisation). A finite step restores the hysteresis allowance
        and, after ``growth_interval`` of them in a row, multiplies the scale by ``growth_factor`` (capped at
        ``max_scale``). A non-finite step resets the growth count and uses one unit of hysteresis; once it is
        used up, the scale is multiplied by ``backoff_factor``.

        Raises:
            FloatingPointError: the backoff would take the scale below ``min_scale``.
        """
        if not self.enabled:
            return
        if isinstance(found_inf, Tensor):
            found_inf = self.found_inf(found_inf)
        self._steps += 1
        if not found_inf:
            self._last_unscaled = []
            self._hysteresis_tracker = self.hysteresis
            if not self.dynamic:
                return
            self._growth_tracker += 1
            if self._growth_tracker >= self.growth_interval:
                self._growth_tracker = 0
                self._set_scale(min(self._scale_value * self.growth_factor, self.max_scale))
            return
        self._skipped_steps += 1
        if not self.dynamic:
            self._last_unscaled = []
            return
        self._growth_tracker = 0
        self._hysteresis_tracker -= 1
        if self._hysteresis_tracker > 0:
            self._last_unscaled = []
            return
        new_scale = self._scale_value * self.backoff_factor
        if new_scale < self.min_scale:
            names = self.nonfinite_grad_names()
            self._last_unscaled = []
            shown = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
            raise FloatingPointError(
                f"Loss scale {self._scale_value:g} cannot back off below min_scale={self.min_scale:g} "
                f"(backoff_factor={self.backoff_factor:g}): gradients are non-finite even at the minimum scale. "
                f"Non-finite gradients in: {shown or 'unknown parameters (pass (name, param) pairs to unscale_)'}. "
                "Look for an overflow in the forward pass of these parameters' modules (run them in fp32), "
                "a too-large learning rate, or bad input data."
            )
        self._last_unscaled = []
        self._set_scale(new_scale)

    def nonfinite_grad_names(self) -> list[str]:
        """Names of the parameters whose gradients, as last unscaled, hold inf or NaN (costs a sync each)."""
        return [name for name, grad in self._last_unscaled if not bool(torch.isfinite(grad).all())]

    def _set_scale(self, value: float) -> None:
        # a new tensor, not an in-place fill: `_scale_in_grads` must keep the scale the grads were made with
        self._scale_value = value
        if self._scale_tensor is not None:
            self._scale_tensor = torch.full((), value, dtype=torch.float32, device=self._scale_tensor.device)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: scale, trackers, counters and the settings."""
        return {
            "scale": self._scale_value,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
            "steps": self._steps,
            "skipped_steps": self._skipped_steps,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "dynamic": self.dynamic,
            "enabled": self.enabled,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. The checkpoint's settings replace the constructor's, as in torch."""
        missing = sorted({"scale", "growth_tracker", "hysteresis_tracker", "skipped_steps"} - set(state_dict))
        if missing:
            raise KeyError(f"DynamicLossScaler state_dict lacks {missing}; got keys {sorted(state_dict)}.")
        for key in ("growth_factor", "backoff_factor", "min_scale", "max_scale"):
            setattr(self, key, float(state_dict.get(key, getattr(self, key))))
        for key in ("growth_interval", "hysteresis"):
            setattr(self, key, int(state_dict.get(key, getattr(self, key))))
        self.dynamic = bool(state_dict.get("dynamic", self.dynamic))
        self.enabled = bool(state_dict.get("enabled", self.enabled))
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
        self._steps = int(state_dict.get("steps", 0))
        self._skipped_steps = int(state_dict["skipped_steps"])
        self._scale_in_grads = None
        self._set_scale(float(state_dict["scale"]))

    def __repr__(self) -> str:
        if not self.enabled:
            return f"{type(self).__name__}(enabled=False)"
        if not self.dynamic:
            return f"{type(self).__name__}.static({self._scale_value:g})"
        return (
            f"{type(self).__name__}(scale={self._scale_value:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale:g}, max_scale={self.max_scale:g})"
        )


def _check_positive_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} is not allowed: it must be a finite number > 0.")


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not allowed: it must be an integer >= 1.")
