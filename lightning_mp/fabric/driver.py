"""The plugin's hold on a Fabric strategy: where the masters connect, the step, clipping, checkpoints.
See :mod:`lightning_mp.fabric`."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer

from lightning_mp import stepping
from lightning_mp.master import in_backward_loop
from lightning_mp.schedulers import guard_scheduler

#: The strategy methods a Fabric-driven plugin wraps (on the strategy object, never on its class).
WRAPPED = (
    "setup_module_and_optimizers",
    "setup_module",
    "setup_optimizer",
    "optimizer_step",
    "clip_gradients_norm",
    "clip_gradients_value",
    "save_checkpoint",
    "load_checkpoint",
)


class FabricDriver:
    """The plugin's hold on one Fabric strategy object: where the masters connect, the step, clipping, checkpoints.

    Args:
        plugin: the :class:`~lightning_mp.MixedPrecisionPlugin` the Fabric was given.
        strategy: that Fabric's strategy; the methods in :data:`WRAPPED` are wrapped on this object (instance
            attributes, removed by :meth:`release`).
    """

    def __init__(self, plugin: Any, strategy: Any) -> None:  # the plugin: not imported here (it imports this)
        self.plugin = plugin
        self.strategy = strategy
        self.module: Optional[Module] = None  # what the strategy's setup_module returned (a DDP wrapper, ...)
        self.optimizers: list[Optimizer] = []
        self.connected = False
        self.scaled_loss: Optional[Tensor] = None  # pre_backward's scaled loss, for backward (Fabric drops it)
        self._joint = False
        self._originals = {name: getattr(strategy, name) for name in WRAPPED}
        for name in WRAPPED:
            setattr(strategy, name, getattr(self, name))

    @property
    def key(self) -> str:
        """The plugin's key in a checkpoint written by ``fabric.save`` (the Trainer's key: the class's name)."""
        return type(self.plugin).__qualname__

    def release(self) -> None:
        """Give the strategy its own methods back."""
        for name in WRAPPED:
            self.strategy.__dict__.pop(name, None)

    # ------------------------------------------------------------------ setup: where the masters connect
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer], *args: Any) -> Any:
        self._joint = True  # the strategy calls setup_module and setup_optimizer inside: connect once, after both
        try:
            module, optimizers, scheduler = self._originals["setup_module_and_optimizers"](module, optimizers, *args)
        finally:
            self._joint = False
        self.module = module
        self._connect(list(optimizers))
        if scheduler is not None:  # fabric.setup(..., scheduler=): it does not advance on a skipped step
            guard_scheduler(scheduler)
        return module, optimizers, scheduler

    def setup_module(self, module: Module) -> Module:
        self.module = self._originals["setup_module"](module)
        self.connected = False  # a module set up again (or anew) connects again
        self.plugin._start_following(self.module)  # writes from now on reach the masters (connect: first forward)
        return self.module

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        optimizer = self._originals["setup_optimizer"](optimizer)
        if not self._joint:
            self._connect([optimizer]) if not self.connected else self._attach(optimizer)
        return optimizer

    def ensure_connected(self) -> None:
        """Connect a module set up without optimizers (its first forward or backward)."""
        if not self.connected and self.module is not None:
            self._connect([])

    def _connect(self, optimizers: list[Optimizer]) -> None:
        if self.module is None:
            raise RuntimeError("MixedPrecisionPlugin: an optimizer was set up before its model: call fabric.setup().")
        self.optimizers = optimizers
        self.plugin.connect(self.module, optimizers, [])
        self.connected = True

    def _attach(self, optimizer: Optimizer) -> None:
        # an optimizer set up after the module connected (setup_module, then setup_optimizers one by one)
        plugin = self.plugin
        self.optimizers.append(optimizer)
        if plugin.masters is not None and not plugin._sync.owns_masters:
            plugin.masters.attach(self.optimizers)
            for param, master in plugin.masters.pairs():
                plugin._param_names[id(master)] = plugin._param_names.get(id(param), "")
        if plugin.fp8 is not None:
            inner = getattr(self.module, "module", self.module)
            plugin.fp8.connect(inner, [optimizer])
        if plugin.optimizer_in_backward:  # the hooks move to every optimizer set up (several are refused)
            in_backward_loop.add_optimizer(plugin, getattr(self.module, "module", self.module), self.optimizers)
        plugin._start_following(self.module)

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` through Fabric: unscale once, check, agree over ranks, step or skip, update the
        scale, as the Trainer's step after its closure (:func:`lightning_mp.stepping.step_after_backward`)."""
        plugin = self.plugin
        self.ensure_connected()
        if plugin._in_backward is not None:  # fabric.backward performed the updates: bookkeeping only
            plugin.follow_model_writes()  # a write since the backward reaches the masters, as before a normal step
            in_backward_loop.finish_step(plugin, optimizer, self.module)  # a skip goes to the skip observers too
            return None
        masters = plugin.masters
        if isinstance(optimizer, LBFGS) and (plugin._checking or masters is not None):
            raise TypeError(
                "MixedPrecisionPlugin with an inf/NaN check or master weights cannot drive LBFGS: it re-evaluates "
                "the closure inside step(), where gradients cannot be checked and the half model is stale. Use "
                "MixedPrecisionPlugin('bf16-mixed', scaler={'enabled': False}) without master weights, or fp32."
            )
        return stepping.step_after_backward(plugin, optimizer, self.module, kwargs)  # the order lives there

    # ------------------------------------------------------------------ clipping (fabric.clip_gradients)
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the total norm of the unscaled gradients (the fp32 master gradients where there are masters).
        With an inf/NaN check, a non-finite norm does not raise: that step is skipped by ``optimizer.step()``."""
        plugin = self.plugin
        in_backward_loop.refuse_clipping(plugin, max_norm, "norm", f"fabric.clip_gradients(max_norm={max_norm})")
        plugin.unscale_gradients(optimizer)
        check = error_if_nonfinite and not plugin._checking
        lean = getattr(plugin.masters, "clip_grad_norm_", None)
        if lean is None:
            params = list(plugin.main_params(optimizer))
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite=check)
        total = lean(optimizer, max_norm, norm_type)  # fp32, applied inside the lean step
        if check and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients is non-finite, so it cannot be clipped. "
                "To disable this error, use fabric.clip_gradients(..., error_if_nonfinite=False)."
            )
        return total

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp the unscaled gradients to ``[-clip_val, clip_val]`` (lean masters: in fp32, inside the step)."""
        plugin = self.plugin
        in_backward_loop.refuse_clipping(plugin, clip_val, "value", f"fabric.clip_gradients(clip_val={clip_val})")
        plugin.unscale_gradients(optimizer)
        if not any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
            return
        lean = getattr(plugin.masters, "clip_grad_value_", None)
        if lean is not None:
            lean(optimizer, clip_val)
        else:
            torch.nn.utils.clip_grad_value_(list(plugin.main_params(optimizer)), clip_val)

    # ------------------------------------------------------------------ checkpoints (fabric.save / fabric.load)
    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if not any(value is self.plugin for value in state.values()):
            state = {**state, self.key: self.plugin}  # a state_dict()/load_state_dict() object: Fabric converts it
        return self._originals["save_checkpoint"](path, state, *args, **kwargs)

    def load_checkpoint(self, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> Any:
        remainder = self._originals["load_checkpoint"](path, state, *args, **kwargs)
        restores = isinstance(state, dict) and state and not any(v is self.plugin for v in state.values())
        if restores and isinstance(remainder, dict) and self.key in remainder:
            self.plugin.load_state_dict(remainder.pop(self.key), source=f"{path}[{self.key!r}]")
        return remainder
