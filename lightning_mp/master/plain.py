"""The one interface through which an optimizer step reaches the weights it updates, with or without masters.

:class:`PlainWeights` is the model's own parameters (no master weights): the optimizer updates them, clipping is
torch's. :class:`~lightning_mp.master.MasterWeights` (fp32 copies) and :class:`~lightning_mp.master.RemainderMasters`
(lean) implement the same methods, so that the step (:class:`lightning_mp.stepping.OptimizerStep`) never asks which
kind runs: it calls :meth:`~PlainWeights.step`, :meth:`~PlainWeights.clip_grad_norm_` and
:meth:`~PlainWeights.clip_grad_value_`, and asks :meth:`~PlainWeights.skips_on_device`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor
from torch.optim import Optimizer


class PlainWeights:
    """The model's own parameters, updated by the optimizer: the step without master weights."""

    #: Whether :meth:`step` updates the weights itself and takes the found-inf flag (so a step can be skipped on
    #: the device whatever the optimizer); otherwise the optimizer's own ``step`` runs.
    updates_itself = False
    #: Whether the masters are lean (bf16 weights + 16-bit remainders): what strategies that reduce gradients
    #: need to know (lean gradients are reduced in their own buckets).
    lean = False
    #: The ``master_weights`` option this stands for (``False``, ``True``, ``"remainder"``).
    option: Union[bool, str] = False

    def step(self, optimizer: Optimizer, found_inf: Optional[Tensor], run: Optional[Callable[[], Any]]) -> Any:
        """Update ``optimizer``'s weights. ``run`` steps the optimizer itself (skipping where ``found_inf``, a 0/1
        device flag, is 1, when the optimizer takes it); weights that update themselves take ``found_inf`` and do
        not call ``run``. Returns what the optimizer's step returned."""
        assert run is not None
        return run()

    def skips_on_device(self, optimizer: Optimizer) -> bool:
        """Whether a step of ``optimizer`` can be skipped on the device by a found-inf flag: these weights update
        themselves (:attr:`updates_itself`), or the optimizer follows ``torch.amp.GradScaler``'s attribute protocol:
        it declares ``_step_supports_amp_scaling`` (torch's ``fused=True`` Adam, AdamW, SGD, Adagrad) and its
        ``step`` has no ``grad_scaler`` argument (the deprecated protocol, which expects a torch ``GradScaler``)."""
        if self.updates_itself:
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

    def clip_grad_norm_(
        self, optimizer: Optimizer, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients the update uses (``optimizer``'s parameters') by their total norm, as
        ``torch.nn.utils.clip_grad_norm_``; returns the total norm."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_grad_value_(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp the gradients the update uses to ``[-clip_value, clip_value]``, as ``torch.nn.utils.clip_grad_value_``."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(params, clip_value)


_HONOURS_FOUND_INF: dict[type, bool] = {}  # optimizer class -> whether its step takes the found_inf attribute

#: The step's weights without masters.
PLAIN = PlainWeights()
