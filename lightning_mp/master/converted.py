"""The model converted for master weights, as both stores hold it: which parameters and buffers become 16-bit, their
fp32 values until masters hold them, and the model sync made at the conversion.

:class:`ConvertedModel` is the small common base of :class:`~lightning_mp.master.MasterWeights` (fp32 copies) and
:class:`~lightning_mp.master.RemainderMasters` (lean): each implements the weights interface
(:class:`~lightning_mp.master.plain.PlainWeights`) beside the other, and shares only this: the walk of ``convert``
(the ``keep_fp32`` rule over the module tree, tied parameters, buffers), the fp32 value of a converted parameter no
master holds, the buffers' values at teardown, the refused callbacks and the model sync's start and stop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.master import exact
from lightning_mp.master.buffers import ConvertedBuffers
from lightning_mp.master.following import Generation, seen
from lightning_mp.master.model_sync import ModelSync, ModelWriteError, materialise, stop
from lightning_mp.master.plain import PlainWeights
from lightning_mp.master.refused_callbacks import refuse_callbacks

#: Module classes whose parameters and buffers stay fp32 by default (and their subclasses).
NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def is_norm(name: str, module: nn.Module) -> bool:
    """The default ``keep_fp32`` rule: normalisation layers keep fp32 parameters and statistics."""
    return isinstance(module, NORM_TYPES)


def take_changed(exact: Tensor, half: Tensor) -> int:
    """Where the 16-bit ``half`` no longer holds ``exact``'s rounding (a write changed it), ``exact`` takes ``half``'s
    value; the other elements keep theirs. Returns how many changed (one comparison; one host read)."""
    changed = half != exact.to(half.dtype)
    exact.copy_(torch.where(changed, half.to(exact.dtype), exact))
    return int(changed.sum())


class ConvertedModel(PlainWeights):
    """A module cast to ``dtype`` for master weights (module doc): the state both stores share, and their common steps.

    Args:
        dtype: the 16-bit dtype the model runs in (each store checks which it supports).
        keep_fp32: ``keep_fp32(qualified_name, module)`` is true for modules whose own parameters and buffers stay
            fp32, and with them those of every module inside them.
    """

    holds_masters = True

    def __init__(self, dtype: torch.dtype, keep_fp32: Callable[[str, nn.Module], bool] = is_norm) -> None:
        self.dtype = dtype
        self.keep_fp32 = keep_fp32
        self._reset()

    def _reset(self) -> None:
        self._module: Optional[nn.Module] = None
        self.model_sync: Optional[ModelSync] = None  # hooks and check: every write to the model reaches the masters
        self._params: dict[int, nn.Parameter] = {}  # id(half model param) -> the param, for every converted one
        # fp32 values of the half parameters before the cast (the original tensors), until masters replace them
        self._fp32_values: dict[int, Tensor] = {}
        self._buffers = ConvertedBuffers()  # the model's 16-bit buffers and the full-precision values they stand for
        self._optimizers: list[Optimizer] = []
        #: each optimizer with its groups' generation as last followed (following.seen); none recorded: a subclass
        #: attached (FSDP2), not followed
        self._groups_at: list[tuple[Optimizer, int]] = []

    # ------------------------------------------------------------------ setup
    def _kept_modules(self, module: nn.Module) -> dict[str, nn.Module]:
        # a module kept in fp32 runs its whole subtree in fp32 (lightning_mp.forward.ModuleRules: autocast off,
        # inputs upcast), so the modules inside it keep fp32 parameters too: an fp16 Linear inside an fp32 attention
        # block would meet fp32 inputs with autocast off
        kept: dict[str, nn.Module] = {}
        for module_name, owner in module.named_modules():
            inside = any(module_name.startswith(f"{name}.") or not name for name in kept)
            if inside or self.keep_fp32(module_name, owner):
                kept[module_name] = owner
        return kept

    def convert(self, module: nn.Module) -> nn.Module:
        """Cast ``module``'s floating parameters and buffers to ``dtype`` in place, except ``keep_fp32`` ones.

        Parameters keep their identity (only ``.data`` changes), so optimizers created afterwards see the half
        parameters; each converted parameter is handed to the store (``_cast_param``), which keeps its exact fp32
        value. A parameter shared by several modules (tied weights: GPT-2's ``lm_head.weight`` is
        ``transformer.wte.weight``) stays fp32 under every name when any module that holds it is kept in fp32.
        """
        if self._module is not None:
            self.restore()
        self._module = module
        kept_modules = self._kept_modules(module)
        kept = {id(param) for owner in kept_modules.values() for param in owner.parameters(recurse=False)}
        for module_name, owner in module.named_modules():
            if module_name in kept_modules:
                continue
            for _name, param in owner.named_parameters(recurse=False):
                if not param.is_floating_point() or id(param) in self._params or id(param) in kept:
                    continue
                self._params[id(param)] = param  # a model that arrives in half precision gets masters too
                self._cast_param(param)
            for name, buffer in list(owner.named_buffers(recurse=False)):
                if buffer is not None and buffer.is_floating_point() and buffer.dtype != self.dtype:
                    self._buffers.convert(owner, name, self.dtype)
        self.model_sync = ModelSync(self, module, self._params, self._buffers)
        return module

    def _cast_param(self, param: nn.Parameter) -> None:
        """Hold the converted parameter ``param`` (each store: its own way)."""
        raise NotImplementedError

    # what the model sync reads of every store (model_sync.MasterStore), each store its own way
    def fp32_value(self, param: Tensor) -> Tensor:
        """The exact fp32 value of a converted parameter."""
        raise NotImplementedError

    def load_fp32(self, param: nn.Parameter, value: Any) -> None:
        """A load brought ``value`` for ``param``: the masters take it exactly."""
        raise NotImplementedError

    def follow_write(self, param: nn.Parameter, value: Optional[Tensor]) -> int:
        """``param`` was written outside the step; how many values were taken at 16-bit precision."""
        raise NotImplementedError

    def check_callbacks(self, callbacks: Iterable[Any]) -> None:
        """Raise, before any step, for a Trainer callback the masters cannot run with
        (:func:`~lightning_mp.master.refused_callbacks.refuse_callbacks`: Lightning's ``BaseFinetuning``, which names
        the optimizer's parameters, fp32 masters when the groups hold them; ``ModelPruning``)."""
        refuse_callbacks(callbacks, self.option, reads_groups=self.groups_hold_masters)

    # ------------------------------------------------------------------ the groups followed
    def _record_groups(self) -> None:
        """The optimizers' groups, as they are now, are the ones followed."""
        self._groups_at = [(optimizer, seen(optimizer).groups) for optimizer in self._optimizers]

    def _groups_changed(self, optimizer: Optional[Optimizer] = None, now: Optional[Generation] = None) -> bool:
        """Whether any followed optimizer's groups changed since :meth:`_record_groups` (``now``: ``optimizer``'s
        generation, asked already)."""
        for held, at in self._groups_at:
            if (now.groups if now is not None and held is optimizer else seen(held).groups) != at:
                return True
        return False

    # ------------------------------------------------------------------ values no master holds
    def _kept_value(self, param: Tensor) -> Tensor:
        """The full-precision value of a converted parameter no master holds: its pre-cast value, or an upcast."""
        kept = self._fp32_values.get(id(param))
        return kept if kept is not None else param.detach().float()

    def _load_kept(self, param: nn.Parameter, value: Any) -> None:
        """A load into a converted parameter no master holds (before attach, or not trained): its fp32 value is kept
        until one does (or until restore), the model gets its rounding."""
        kept = self._fp32_values[id(param)] = materialise(value, param.shape, param.device)
        self._round_into(param, kept)

    def _round_into(self, param: nn.Parameter, value: Tensor) -> None:
        """The model's 16-bit copy of the fp32 ``value`` (``param.data = fp32 tensor`` before a load: half again)."""
        if param.dtype != self.dtype:
            param.data = value.to(self.dtype)
        else:
            param.copy_(value)

    def _follow_kept(self, param: nn.Parameter, value: Optional[Tensor]) -> int:
        """A write into a converted parameter no master holds (see ``follow_write``): the kept fp32 value follows
        (element by element for a write in place). Returns how many values were taken at 16-bit precision."""
        if value is None:
            kept = self._fp32_values.get(id(param))
            if kept is None:  # the kept value is the model's, upcast: exact
                return 0
            return take_changed(kept, param.detach())
        self._fp32_values[id(param)] = value.detach().to(torch.float32, copy=True)
        param.data = value.detach().to(self.dtype, copy=True)  # a copy: no storage shared with the tensor written
        return 0

    # ------------------------------------------------------------------ the code around the step
    def exact_weights(self, module: nn.Module, write: bool = True) -> contextlib.AbstractContextManager[nn.Module]:
        """:func:`lightning_mp.master.exact_weights` over these masters (``module`` must be one they hold)."""
        return exact.exact_weights(module, store=self, write=write)

    def exact_parameters(self, module: nn.Module) -> Iterator[tuple[str, Tensor]]:
        """:func:`lightning_mp.master.exact_parameters` over these masters (``module`` must be one they hold)."""
        return exact.exact_parameters(module, store=self)

    # ------------------------------------------------------------------ teardown
    def _restore_buffers(self) -> None:
        """The model's buffers back at full precision, with what training wrote into them
        (:meth:`~lightning_mp.master.buffers.ConvertedBuffers.restore`)."""
        self._buffers.restore()

    def stop_following(self) -> Optional[ModelWriteError]:
        """Follow the writes since the last step, then remove the hooks
        (:func:`~lightning_mp.master.model_sync.stop`)."""
        sync, self.model_sync = self.model_sync, None
        return stop(sync)
