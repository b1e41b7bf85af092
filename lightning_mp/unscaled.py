"""Which optimizers' gradients are unscaled, tied to the backward that produced them.

The plugin's one invariant: every ``optimizer.step()`` it lets through sees gradients unscaled exactly once since
the backward that produced them, and checked for inf/NaN. Unscaling can happen early (``clip_gradients`` in
manual optimization, or clipping on a step whose ``training_step`` returned ``None``) and the step that would
consume it may never come (a batch that clips but does not step). So the record of "these gradients are
unscaled" lives here, and a new backward ends it: gradients still unscaled are multiplied back by the scale they
were unscaled with, so that the new, scaled gradients add up with them consistently and the next step unscales
the sum once. A step consumes its record. No state outlives the gradients it describes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_mp.scaler import DynamicLossScaler


class UnscaledGradients:
    """Per-optimizer record of gradients unscaled since their backward, for one :class:`DynamicLossScaler`."""

    def __init__(self, scaler: DynamicLossScaler) -> None:
        self.scaler = scaler
        # id(optimizer) -> (the optimizer, found-inf flag, scale the gradients were unscaled with)
        self._records: dict[int, tuple[Any, Tensor, Tensor]] = {}

    def unscale(self, optimizer: Any, named_params: list[tuple[str, Tensor]]) -> Tensor:
        """Unscale ``optimizer``'s gradients unless already done since their backward; the found-inf flag."""
        record = self._records.get(id(optimizer))
        if record is None:
            scale = self.scaler.scale_of_grads()
            record = (optimizer, self.scaler.unscale_(named_params), scale)
            self._records[id(optimizer)] = record
        return record[1]

    def is_unscaled(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s gradients were unscaled since the backward that produced them."""
        return id(optimizer) in self._records

    def consumed(self, optimizer: Any) -> None:
        """The step of ``optimizer`` was decided (taken or skipped): its record ends."""
        self._records.pop(id(optimizer), None)

    def new_backward(self) -> None:
        """A backward is about to add scaled gradients: scale back whatever is still unscaled, end every record."""
        for optimizer, _, scale in self._records.values():
            if self.scaler.check_only:
                continue
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(scale.to(param.grad.device))
        self._records.clear()

    def clear(self) -> None:
        self._records.clear()
