"""The one interface through which the plugin and the step reach the weights they update, with or without masters.

:class:`PlainWeights` is the model's own parameters (no master weights): the optimizer updates them, clipping is
torch's, and every step of the lifecycle is a no-op. :class:`~lightning_mp.master.MasterWeights` (fp32 copies) and
:class:`~lightning_mp.master.RemainderMasters` (lean) implement the same methods, beside each other (their small
common base: :mod:`lightning_mp.master.converted`), so that neither the step
(:class:`lightning_mp.stepping.OptimizerStep`) nor the plugin asks which kind runs, or whether masters exist:

- setup: :meth:`~PlainWeights.convert` (the model cast), :meth:`~PlainWeights.check_callbacks`,
  :meth:`~PlainWeights.attach` (the optimizers), :meth:`~PlainWeights.follow_optimizers` (swapped mid-fit),
  :meth:`~PlainWeights.start_following` (writes into the model reach the masters from now on);
- each step: :meth:`~PlainWeights.before_backward`, :meth:`~PlainWeights.grads_to_masters`,
  :meth:`~PlainWeights.follow_shown_grads`, :meth:`~PlainWeights.follow_writes`, :meth:`~PlainWeights.step`, :meth:`~PlainWeights.clip_grad_norm_`,
  :meth:`~PlainWeights.clip_grad_value_`, :meth:`~PlainWeights.skips_on_device`;
- the code around the step: :meth:`~PlainWeights.exact_weights`, :meth:`~PlainWeights.exact_parameters`,
  :meth:`~PlainWeights.pairs`, :meth:`~PlainWeights.fp32_pairs`, :meth:`~PlainWeights.master_of`;
- teardown: :meth:`~PlainWeights.restore`.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.master import exact
from lightning_mp.master.model_sync import start_following


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
    #: Whether the model is held in half precision with master weights (what ``plugin.master_weights`` says).
    holds_masters = False
    #: Whether a write in place into the model can be followed element by element (the masters keep what the write
    #: left as it was): fp32 masters can compare with their rounding; lean masters hold no copy of the 16-bit weights.
    tells_changed_values = True
    #: Whether the optimizers' param groups hold fp32 masters instead of the model's parameters (``toggle_optimizer``
    #: and callbacks that name the groups' parameters must then be told).
    groups_hold_masters = False
    #: What keeps the masters equal to the model (:class:`~lightning_mp.master.model_sync.ModelSync`): none here.
    model_sync: Optional[Any] = None
    #: Whether the gradients move between the model and the masters (:meth:`grads_to_masters`,
    #: :meth:`follow_shown_grads` do something): fp32 masters only. The step calls neither where it is ``False``.
    moves_grads = False

    # ------------------------------------------------------------------ setup
    def convert(self, module: nn.Module) -> nn.Module:
        """Cast ``module`` for the masters, in place; here nothing changes (the model is trained as it is)."""
        return module

    def check_callbacks(self, callbacks: Iterable[Any]) -> None:
        """Raise, before any step, for a Trainer callback these weights cannot run with: none here."""

    def attach(self, optimizers: Iterable[Optimizer]) -> None:
        """Prepare ``optimizers`` (masters in their groups, their state's dtype): nothing here."""

    def follow_optimizers(self, optimizers: Iterable[Optimizer]) -> None:
        """The run steps ``optimizers`` now (swapped mid-fit): nothing to move here."""

    def start_following(self, model: Optional[nn.Module] = None) -> None:
        """Setup is over: from now on every write into ``model`` reaches the masters (where a model sync runs;
        :func:`~lightning_mp.master.model_sync.start_following`)."""
        start_following(self, model)

    # ------------------------------------------------------------------ per step
    def before_backward(self) -> None:
        """Called before every backward (masters follow edited param groups; lean ones widen gradients)."""

    def grads_to_masters(self) -> None:
        """Called after every backward: the half gradients move to the masters; here they stay where they are."""

    def follow_shown_grads(self) -> None:
        """Called before every backward, before the gradients are unscaled, clipped or stepped, and after the step's
        ``zero_grad``: where the masters' gradients are shown as the model's ``p.grad``, the two agree again (what code
        did to either side since is followed); here the model's gradients are the ones the optimizer steps."""

    def follow_writes(self) -> None:
        """Make the masters follow every write into the model since the last step, or raise
        :class:`~lightning_mp.master.model_sync.ModelWriteError` (:meth:`~lightning_mp.master.model_sync.ModelSync.
        follow`; nothing without a model sync)."""
        if self.model_sync is not None:
            self.model_sync.follow()

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

    # ------------------------------------------------------------------ the code around the step
    def pairs(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """``(half model parameter, fp32 master tensor)`` for every trained parameter that has one: none here."""
        return iter(())

    def fp32_pairs(self) -> Iterator[tuple[nn.Parameter, Tensor]]:
        """``(half model parameter, its exact fp32 value)`` for every trained parameter with masters: the masters
        themselves where they are fp32 tensors (:meth:`pairs`); lean masters join theirs when asked."""
        return self.pairs()

    def master_of(self, param: Tensor) -> Optional[nn.Parameter]:
        """The fp32 master tensor of a model parameter (``None``: it has none, as here)."""
        return None

    def exact_weights(self, module: nn.Module, write: bool = True) -> contextlib.AbstractContextManager[nn.Module]:
        """:func:`lightning_mp.master.exact_weights`: without masters the parameters are given as they are (they are
        the exact weights), or those of the masters that run ``module``."""
        return exact.exact_weights(module, write=write)

    def exact_parameters(self, module: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """:func:`lightning_mp.master.exact_parameters`: without masters the parameters as they are."""
        return exact.exact_parameters(module)

    # ------------------------------------------------------------------ teardown
    def restore(self) -> None:
        """Give the model back its full-precision values and the optimizers the model's parameters: nothing here."""


_HONOURS_FOUND_INF: dict[type, bool] = {}  # optimizer class -> whether its step takes the found_inf attribute

#: The step's weights without masters.
PLAIN = PlainWeights()


class StrategyMasters(PlainWeights):
    """fp32 masters the strategy keeps itself: FSDP2's sharded fp32 parameters, all-gathered in a half
    ``param_dtype`` (``master_weights=True`` under FSDP2). The plugin converts, attaches and restores nothing: the
    optimizer steps those parameters as they are, as without masters; but the model runs in half precision, so the
    plugin says it holds masters (``plugin.master_weights``) and what needs a whole half model is refused as with
    masters. ``single_device``: the plugin's own store, used again on one device."""

    holds_masters = True
    option: Union[bool, str] = True

    def __init__(self, single_device: PlainWeights) -> None:
        self.single_device = single_device
