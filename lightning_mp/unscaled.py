"""Which optimizers' gradients are unscaled, tied to the backward that produced them.

The plugin's one invariant: every ``optimizer.step()`` it lets through sees gradients unscaled exactly once since
the backward that produced them, and checked for inf/NaN. Unscaling can happen early (``clip_gradients`` in
manual optimization, or clipping on a step whose ``training_step`` returned ``None``) and the step that would
consume it may never come (a batch that clips but does not step). So the record of "these gradients are
unscaled" lives here, and a new backward ends it: gradients still unscaled are multiplied back by the scale they
were unscaled with, so that the new, scaled gradients add up with them consistently and the next step unscales
the sum once. What that earlier unscale found is carried too (a device tensor, no sync): value clipping can clamp
an inf away, yet the step those gradients feed into must still be skipped. A step consumes its record. No state
outlives the gradients it describes: if they are gone (``zero_grad()``) when the next backward starts, nothing is
carried.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mp.scaler import DynamicLossScaler


class UnscaledGradients:
    """Per-optimizer record of gradients unscaled since their backward.

    It holds no scaler: the plugin owns the one :class:`DynamicLossScaler` and passes it to each call, so a scaler
    replaced on the plugin (or spied on by a test) is the one used.
    """

    def __init__(self) -> None:
        # id(optimizer) -> (the optimizer, found-inf flag, scale the gradients were unscaled with; None: check-only)
        self._records: dict[int, tuple[Any, Tensor, Optional[Tensor]]] = {}
        # id(optimizer) -> found-inf flag of unscaled gradients that a later backward adds to
        self._carried: dict[int, Tensor] = {}
        # id(optimizer) -> (its parameter lists, when named; the (name, parameter) pairs): named once, not every step
        self._named: dict[int, tuple[list[Any], list[tuple[str, Tensor]]]] = {}

    def unscale(self, scaler: DynamicLossScaler, optimizer: Any, names: dict[int, str]) -> Tensor:
        """Unscale ``optimizer``'s gradients unless already done since their backward; the found-inf flag.
        ``names``: ``id(parameter) -> name`` (a parameter without one is named by its place in ``param_groups``)."""
        record = self._records.get(id(optimizer))
        if record is None:
            scale = scaler.scale_of_grads() if not scaler.check_only else None  # check-only: nothing to scale back
            found_inf = scaler.unscale_(self._named_params(optimizer, names))
            carried = self._carried.pop(id(optimizer), None)
            if carried is not None:
                found_inf = found_inf + carried.to(found_inf.device)
            record = (optimizer, found_inf, scale)
            self._records[id(optimizer)] = record
        return record[1]

    def _named_params(self, optimizer: Any, names: dict[int, str]) -> list[tuple[str, Tensor]]:
        lists = [group["params"] for group in optimizer.param_groups]
        cached = self._named.get(id(optimizer))
        if (
            cached is None
            or len(cached[0]) != len(lists)
            or not all(  # the same parameters, in the same places
                len(params) == len(seen) and all(map(operator.is_, params, seen))
                for params, seen in zip(lists, cached[0])
            )
        ):
            named = [
                (names.get(id(param), f"param_groups[{g}][{i}]"), param)
                for g, params in enumerate(lists)
                for i, param in enumerate(params)
            ]
            cached = ([list(params) for params in lists], named)
            self._named[id(optimizer)] = cached
        return cached[1]

    def is_unscaled(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s gradients were unscaled since the backward that produced them."""
        return id(optimizer) in self._records

    def consumed(self, optimizer: Any) -> None:
        """The step of ``optimizer`` was decided (taken or skipped): its record ends."""
        self._records.pop(id(optimizer), None)
        self._carried.pop(id(optimizer), None)

    def new_backward(self, scaler: DynamicLossScaler) -> None:
        """A backward is about to add scaled gradients: scale back whatever is still unscaled and carry what its
        check found; end every record."""
        for key, (optimizer, found_inf, scale) in self._records.items():
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if not grads:  # zero_grad() since: nothing left to scale back or to carry
                continue
            self._carried[key] = found_inf
            if scale is not None and not scaler.check_only:
                with torch.no_grad():
                    for grad in grads:
                        grad.mul_(scale.to(grad.device))
        self._records.clear()

    def clear(self) -> None:
        self._records.clear()
        self._carried.clear()
        self._named.clear()
