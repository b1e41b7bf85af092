"""The plugin's hold on a Fabric strategy: where the masters connect, the step, clipping, checkpoints.
See :mod:`lightning_mp.fabric`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mp.checkpoints.io import REFUSAL
from lightning_mp.schedulers import guard_scheduler

if TYPE_CHECKING:
    from lightning_mp.fp8.convert import Fp8Training
    from lightning_mp.master import PlainWeights
    from lightning_mp.stepping import OptimizerStep


class DrivenPlugin(Protocol):
    """What a :class:`FabricDriver` uses of :class:`~lightning_mp.MixedPrecisionPlugin` (which imports this module,
    so it is named by what it offers): its parts (step owner, masters, fp8) and the calls the Trainer would make
    (``connect``, following the model's writes, the checkpoint state)."""

    optimizer_in_backward: bool
    steps: OptimizerStep
    fp8: Optional[Fp8Training]

    @property
    def masters(self) -> Optional[PlainWeights]: ...  # what masters_for returns

    def connect(self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any: ...

    def start_following_writes(self, model: Optional[Module] = None) -> None: ...

    def load_state_dict(self, state_dict: dict[str, Any], source: Optional[str] = None) -> None: ...


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

    def __init__(self, plugin: DrivenPlugin, strategy: Any) -> None:
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
        self.plugin.start_following_writes(self.module)  # writes from now on reach the masters (connect: first forward)
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
        plugin, steps = self.plugin, self.plugin.steps
        self.optimizers.append(optimizer)
        steps.weights.attach(self.optimizers)
        for param, master in steps.weights.pairs():
            steps.names[id(master)] = steps.names.get(id(param), "")
        if plugin.fp8 is not None and self.module is not None:  # (connected: the module is set)
            inner = getattr(self.module, "module", self.module)
            plugin.fp8.connect(inner, [optimizer])
        if plugin.optimizer_in_backward:  # the hooks move to every optimizer set up (several are refused)
            steps.add_optimizer(getattr(self.module, "module", self.module), self.optimizers)
        plugin.start_following_writes(self.module)

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` through Fabric: the Trainer's step after its closure (unscale once, check, agree over
        ranks, step or skip, update the scale: :meth:`lightning_mp.stepping.OptimizerStep.step_after_backward`)."""
        self.ensure_connected()
        return self.plugin.steps.step_after_backward(optimizer, self.module, kwargs)

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
        steps = self.plugin.steps
        steps.refuse_clipping(max_norm, "norm", f"fabric.clip_gradients(max_norm={max_norm})")
        steps.unscale_before_clipping(optimizer, max_norm)
        return steps.clip_by_norm(optimizer, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp the unscaled gradients to ``[-clip_val, clip_val]`` (lean masters: in fp32, inside the step)."""
        steps = self.plugin.steps
        steps.refuse_clipping(clip_val, "value", f"fabric.clip_gradients(clip_val={clip_val})")
        steps.unscale_before_clipping(optimizer, clip_val)
        steps.clip_by_value(optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints (fabric.save / fabric.load)
    def save_checkpoint(self, path: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if not any(value is self.plugin for value in state.values()):
            state = {**state, self.key: self.plugin}  # a state_dict()/load_state_dict() object: Fabric converts it
        return self._originals["save_checkpoint"](path, state, *args, **kwargs)

    def load_checkpoint(self, path: Any, state: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            remainder = self._originals["load_checkpoint"](path, state, *args, **kwargs)
        except RuntimeError as error:
            if REFUSAL not in str(error):
                raise
            raise RuntimeError(
                f"fabric.load({str(path)!r}): the checkpoint holds tensor subclasses (torchao's 8-bit optimizer "
                "state), which torch cannot load with the callable map_location of Lightning's TorchCheckpointIO. "
                "Nothing was loaded. Pass lightning_mp.TensorSubclassCheckpointIO() in Fabric(plugins=[...]) next to "
                "the MixedPrecisionPlugin: the same load, with map_location='cpu'."
            ) from error
        restores = isinstance(state, dict) and state and not any(v is self.plugin for v in state.values())
        if restores and isinstance(remainder, dict) and self.key in remainder:
            self.plugin.load_state_dict(remainder.pop(self.key), source=f"{path}[{self.key!r}]")
        return remainder
