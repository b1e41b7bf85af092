"""The non-finite flags of the step inside backward: one device vector, filled by the hooks, read only when needed.

:class:`~lightning_mp.master.in_backward.StepInBackward` skips an update on the device: torch's fused kernels and the
one-pass kernel take a 0-dim fp32 ``found`` flag and leave the parameter, its remainder and its optimizer state
unchanged where it is 1. Each parameter's flag is "the loss is non-finite, or this gradient is". :class:`StepFlags`
holds them all in one fp32 vector per device, ``[loss, parameter 0, parameter 1, ...]``, and each parameter's 0-dim
view of its slot, both made once at setup (again only when the optimizer's param groups change). Per step:

* before backward, :meth:`StepFlags.begin` writes the loss's flag into every slot (three small ops, whatever the
  number of parameters);
* each hook's check (:meth:`StepFlags.check`) sets its own slot to 1 on an inf/NaN gradient (one op, the check
  itself), and hands the slot to the update kernel as ``found``;
* after backward nothing is read: :meth:`StepFlags.found` is one device flag for the loss scaler (an ``amax``), and
  :meth:`StepFlags.read` (one host transfer of the vector: whether the loss was non-finite, the names of the
  parameters whose update was skipped) runs only where the decision is needed on the host, by the normal step's rule
  (:class:`lightning_mp.stepping.OptimizerStep`), or when someone asks for the names.

Flags are 0 or 1, as the kernels expect (they skip on exactly 1): a flag summed over ranks is turned back into 0/1
(:func:`agreed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, cast

import torch
from torch import Tensor

from lightning_mp.grads import non_finite_check_and_unscale_
from lightning_mp.master.lean.chunked import local_of

#: ``agree(flag)``: the flag summed over the ranks (:func:`lightning_mp.distributed.sync.agree_found_inf`)
Agree = Callable[[Tensor], Tensor]


def agreed(agree: Agree, flag: Tensor) -> Tensor:
    """``agree(flag)`` (the flag summed over the ranks) as 0 or 1: torch's fused kernels, which update the fp32
    parameters, skip only on a flag of exactly 1, and a sum over ranks can be 2."""
    return (agree(flag) > 0).to(torch.float32)


class StepFlags:
    """The flags of one optimizer's step inside backward (see the module doc).

    Args:
        name: the name of a parameter, for the report of skipped updates.
    """

    def __init__(self, name: Callable[[Tensor], str]) -> None:
        self._name = name
        self._vectors: dict[torch.device, Tensor] = {}  # device -> [loss, its parameters' flags...]
        self._ones: dict[torch.device, Tensor] = {}  # the check-only divisor, 1.0, per device
        self._slots: dict[int, Tensor] = {}  # id(param) -> its 0-dim view into its device's vector
        self._params: dict[torch.device, list[Tensor]] = {}  # device -> the parameters of its slots 1.., in order
        self._loss: Tensor = torch.zeros(())  # the first vector's slot 0
        self._read: Optional[tuple[bool, list[str]]] = None  # this step's read, once made

    def plan(self, params: list[Tensor]) -> None:
        """One slot for each of ``params`` on its (local) device; called at setup and when the param groups change."""
        by_device: dict[torch.device, list[Tensor]] = {}
        for param in params:
            by_device.setdefault(local_of(param).device, []).append(param)
        self._vectors, self._ones, self._slots, self._params = {}, {}, {}, by_device
        self._loss = torch.zeros(())
        for device, on_device in by_device.items():
            vector = self._vectors[device] = torch.zeros(len(on_device) + 1, dtype=torch.float32, device=device)
            self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
            for index, param in enumerate(on_device, start=1):
                self._slots[id(param)] = vector[index]
            if len(self._vectors) == 1:
                self._loss = vector[0]
        self._read = None

    @property
    def on_cpu(self) -> bool:
        """Whether every flag lives on the CPU (reading them there is a memory read, not a synchronisation)."""
        return all(device.type == "cpu" for device in self._vectors)

    def begin(self, loss: Optional[Tensor], agree: Optional[Agree] = None) -> None:
        """Before backward: every slot holds the flag of ``loss`` (1 when any element is inf/NaN; 0 without a loss),
        summed over the ranks by ``agree`` first when given. No host synchronisation."""
        self._read = None
        with torch.no_grad():
            if loss is None:
                for vector in self._vectors.values():
                    vector.zero_()
                return
            bad = loss.mul(0).isnan()  # x * 0 is 0 for a finite x, NaN for inf and NaN
            if bad.dim():
                bad = bad.any()
            if agree is not None:
                bad = agreed(agree, bad.to(torch.float32))
            for vector in self._vectors.values():
                vector.copy_(bad)

    def agree_on_loss(self, agree: Agree) -> None:
        """Replace the loss's flag by ``agree(flag)`` in every slot, keeping what a check set already (under DDP, in
        the first bucket's communication hook: before any update of the reduced gradients reads its slot)."""
        with torch.no_grad():
            loss = agreed(agree, self.loss().clone())  # agree may reduce in place: not into the vector
            for vector in self._vectors.values():
                torch.maximum(vector, loss.to(vector.device), out=vector)

    def check(self, param: Tensor, agree: Optional[Agree] = None) -> Tensor:
        """Set ``param``'s slot to 1 if its gradient holds inf/NaN (summed over the ranks by ``agree`` when given);
        the slot, the ``found`` flag of its update. Called by its hook, under ``torch.no_grad()``."""
        found = self._slots[id(param)]
        grad = local_of(cast(Tensor, param.grad))  # its hook runs with it; FSDP2: the local shard (no collective)
        if grad.device != found.device:  # a gradient elsewhere than its parameter: checked there, written back
            flag = found.to(grad.device)
            non_finite_check_and_unscale_([grad], flag, flag.new_ones(1), check_only=True)
            found.copy_(flag)
            found = flag
        else:  # 1 where the gradient holds inf/NaN, reading it only (the scaler's check-only way)
            non_finite_check_and_unscale_([grad], found, self._ones[found.device], check_only=True)
        if agree is not None:
            found.copy_(agreed(agree, found))
        return found

    def slot(self, param: Tensor) -> Tensor:
        """``param``'s flag: the 0-dim view of its slot (what :meth:`check` sets and returns)."""
        return self._slots[id(param)]

    def loss(self) -> Tensor:
        """The loss's flag (0-dim: the first vector's slot 0), after :meth:`agree_on_loss` the agreed one."""
        return self._loss

    def found(self) -> Tensor:
        """A 0-dim device flag, 1 when the loss or any gradient of the step was non-finite (one op, no read)."""
        if len(self._vectors) == 1:
            return next(iter(self._vectors.values())).amax()
        if not self._vectors:
            return torch.zeros(())
        first = next(iter(self._vectors))
        return torch.stack([vector.amax().to(first) for vector in self._vectors.values()]).amax()

    def read(self) -> tuple[bool, list[str]]:
        """``(whether the loss was non-finite, names of the parameters whose non-finite gradient skipped their
        update)``: one host transfer of the flags, made once per step (later calls return it again)."""
        if self._read is None:
            values: list[float] = []
            for vector in self._vectors.values():
                values.extend(vector.tolist())  # one device: one transfer
            if not values or values[0] > 0:  # a non-finite loss skipped every update: nobody to name
                self._read = (bool(values and values[0] > 0), [])
            else:
                names, start = [], 0
                for params in self._params.values():
                    names += [self._name(p) for p, value in zip(params, values[start + 1 :]) if value > 0]
                    start += len(params) + 1
                self._read = (False, names)
        return self._read
