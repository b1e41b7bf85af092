"""Zero gradients inside backward: the parameters the normal step would update with a gradient of zeros.

With ``optimizer.zero_grad(set_to_none=False)`` a parameter keeps a gradient of zeros once it has had one, and torch's
optimizers (and the normal lean step, which steps every parameter whose ``.grad`` is not ``None``) keep updating it
with that zero gradient when it gets no new one: a parameter frozen mid-fit (``requires_grad_(False)``, Lightning's
``BaseFinetuning.freeze``), or one the forward did not use this step. Weight decay still shrinks it, momentum still
moves it, Adam's step count still advances. With ``set_to_none=True`` (torch's default) its gradient is ``None`` and
it is left alone.

The step inside backward frees each gradient right after its update, so ``zero_grad`` finds nothing to zero, and no
hook fires for a parameter that gets no gradient. :class:`ZeroGrads` keeps what the normal step would hold instead:

* which parameters hold a gradient after a step (``had``): those updated in that step;
* what the user's ``zero_grad`` does, read from one *probe*: the smallest parameter of the optimizer keeps a
  gradient of zeros after its update, and before the next backward its fate tells: ``None`` (``set_to_none=True``), zeroed in
  place (its version counter moved: ``set_to_none=False``), or untouched (no ``zero_grad`` since the step: freed
  then, as every other gradient was). The probe costs its own gradient (the smallest one) at rest, nothing else;
* after backward, each parameter that held a gradient, was zeroed, and was not updated in this backward is updated
  once with a gradient of zeros (made for the update, freed after it), under this step's non-finite flag.

The rule is the normal step's, so the bits are too. Parameters whose gradients a strategy reduces (DDP, FSDP2) take no
probe (a gradient kept there would be written back by the reduction): there ``zero_grad``'s setting is taken as
``set_to_none=True``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import Tensor


class ZeroGrads:
    """Which parameters hold a gradient under the normal step, and which of them a step owes a zero update."""

    def __init__(self) -> None:
        self.probe: Optional[Tensor] = None
        self._seen: Optional[tuple[Tensor, int]] = None  # the probe's gradient left at the last step, its version
        self.kept = False  # zero_grad(set_to_none=False) since the last step: the gradients held stay, as zeros
        self._had: set[int] = set()  # ids of the parameters holding a gradient after the last step
        self.updated: set[int] = set()  # ids of the parameters updated in this backward
        self._marker: Optional[Tensor] = None  # the probe's gradient of zeros, made once; never written by autograd

    def plan(self, params: list[Tensor], excluded: set[int]) -> None:
        """Choose the probe among ``params`` (the optimizer's; ``excluded``: ids whose gradients a strategy reduces):
        the smallest that requires grad, the current one while it is still among them."""
        current = self.probe
        if current is not None and id(current) not in excluded and any(p is current for p in params):
            return
        candidates = [p for p in params if p.requires_grad and id(p) not in excluded]
        self.probe = min(candidates, key=Tensor.numel) if candidates else None
        self._seen, self._marker = None, None

    def begin(self) -> None:
        """Before backward (after the user's ``zero_grad``): read what it did to the probe's gradient."""
        seen, self._seen, self.updated = self._seen, None, set()
        if seen is None or self.probe is None:
            return
        grad = self.probe.grad
        if grad is None:
            self.kept = False  # set_to_none=True
        elif grad is seen[0]:
            if grad._version != seen[1]:
                self.kept = True  # zeroed in place: set_to_none=False
            self.probe.grad = None  # off before backward (as every other gradient): autograd never adds into it

    def keeps(self, param: Tensor) -> bool:
        """In each update: record ``param`` as updated; whether it keeps a gradient (the probe: one tensor of zeros made
        once, so that what a diagnostic reads there is finite and no op is issued per step) instead of freed."""
        self.updated.add(id(param))
        if param is not self.probe:
            return False
        marker = self._marker
        if marker is None or marker.dtype != param.dtype:  # kept through zero_grad(set_to_none=False), the lean
            marker = self._marker = torch.zeros_like(param)  # store's before_backward made it its fp32 sum: anew
        param.grad = self._marker
        return True

    def settle(self, params: list[Tensor], update: Callable[[Tensor], None]) -> None:
        """After backward: ``update`` each of ``params`` the normal step would update now with a zero gradient (made
        for it; ``update`` frees it); then remember who holds a gradient, and the probe's for the next :meth:`begin`."""
        owed = self._had - self.updated if self.kept else set()
        for param in [p for p in params if id(p) in owed] if owed else ():
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            update(param)
        self._had = self.updated | owed
        grad = self.probe.grad if self.probe is not None else None
        self._seen = (grad, grad._version) if grad is not None else None
