"""What the diagnostics need of a skipped step, as a value: :class:`SkippedStep`.

The plugin calls its ``skip_observers`` as ``observer(plugin=, optimizer=, model=)`` on every skipped step, before
the scaler updates (:attr:`lightning_mp.MixedPrecisionPlugin.skip_observers`). The monitors ask the plugin one
question, :meth:`SkipSource.skipped_step`, and work from the answer alone: the diagnostics never import the plugin,
so the plugin (which imports the diagnostics it runs) and the diagnostics do not use each other.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Protocol

from torch import Tensor


@dataclass(frozen=True)
class SkippedStep:
    """A step the loss scaler skipped, as the overflow replay and the monitors read it.

    Attributes:
        scale: the loss scale the step was skipped at (before the scaler updates; ``1.0`` without scaling).
        grads_scale: the scale the step's gradients carry (``1.0`` when the loss is not scaled: bf16's check-only
            scaler, or no check).
        device_type: the autocast device type of the run (``"cpu"``, ``"cuda"``).
        forward_context: the plugin's context around a ``training_step`` (autocast and the casting policy), for a
            replay as trained.
        fp32_weights: ``(model parameter, its exact fp32 value)`` for every parameter with master weights, made when
            called (lean masters materialise their values then): the weights of a replay in fp32.
        skipped_in_backward: the parameters whose update was skipped inside backward (``optimizer_in_backward=True``:
            their gradients are freed by then, so only the step itself can name them); empty otherwise.
    """

    scale: float
    grads_scale: float
    device_type: str
    forward_context: Callable[[], AbstractContextManager[None]]
    fp32_weights: Callable[[], Iterable[tuple[Tensor, Tensor]]]
    skipped_in_backward: tuple[str, ...] = ()


class SkipSource(Protocol):
    """What a skip observer's ``plugin=`` offers the diagnostics: the skipped step, as a value."""

    def skipped_step(self) -> SkippedStep: ...
