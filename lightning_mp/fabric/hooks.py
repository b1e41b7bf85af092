"""The plugin's hooks as Fabric calls them (:class:`FabricHooks`), and how the plugin finds the Fabric that drives
it (:func:`fabric_calling`). See :mod:`lightning_mp.fabric`."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Optional, Protocol

import torch
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_mp.fabric.driver import DrivenPlugin, FabricDriver
from lightning_mp.standalone import lightning_isinstance
from lightning_mp.stepping import has_grads


def fabric_calling(plugin: object, frames: int = 8) -> Any:
    """The ``lightning.fabric.Fabric`` (or ``lightning_fabric.Fabric``) whose method called into ``plugin`` (searched
    ``frames`` frames up) and whose precision plugin ``plugin`` is; ``None`` when there is none (a Trainer, or a hook
    called by hand)."""
    from lightning.fabric import Fabric

    frame: Optional[FrameType] = sys._getframe(1)
    for _ in range(frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if lightning_isinstance(owner, Fabric) and owner._precision is plugin:
            return owner
        frame = frame.f_back
    return None


class _Driven(DrivenPlugin, Protocol):
    """The plugin as the hooks below see it (they are a base of it): what a :class:`FabricDriver` uses of it, and the
    driver itself."""

    _fabric: Optional[FabricDriver]


class FabricHooks:
    """Fabric's side of :class:`~lightning_mp.MixedPrecisionPlugin`: each hook that Fabric calls with another
    meaning does Fabric's part while a Fabric drives the plugin (``_fabric`` set) and Lightning's otherwise."""

    # A base of the plugin before Lightning's Precision: each ``super()`` call below is Precision's hook, which a type
    # checker does not see from this class (hence the ignores on them).

    _fabric: Optional[FabricDriver] = None

    def _strategy_for(self: _Driven, module: Module) -> Any:
        """The strategy the plugin runs under: the Trainer's, or the calling Fabric's (which this plugin then
        drives: see :class:`FabricDriver`); ``None`` when neither (the hooks called by hand)."""
        trainer = getattr(module, "_trainer", None)
        if trainer is not None:
            return trainer.strategy
        fabric = fabric_calling(self)
        if fabric is None:
            return self._fabric.strategy if self._fabric is not None else None
        if self._fabric is not None:
            if self.steps.weights.holds_masters and self._fabric.module is not None:
                raise ValueError(TWO_MODELS_WITH_MASTERS)
            self._fabric.release()
        refuse_lean_fsdp2_before_sharding(self, fabric.strategy, module)
        self._fabric = FabricDriver(self, fabric.strategy)
        return fabric.strategy

    def convert_input(self: _Driven, data: Any) -> Any:
        # Fabric's wrapped module calls this before every forward: a module set up without optimizers connects here,
        # and the gradients the model shows go with the masters' that the loop's optimizer.zero_grad() freed
        if self._fabric is not None:
            self._fabric.ensure_connected()
            self.steps.weights.follow_shown_grads()
        return super().convert_input(data)  # type: ignore[misc]

    def convert_output(self, data: Any) -> Any:
        # as Fabric's own AMP plugin: floating outputs leave the forward in fp32 (torch's default dtype), so a loss
        # the user computes outside the forward (Fabric's loop; under the Trainer it runs in autocast) is fp32
        if self._fabric is None:
            return super().convert_output(data)  # type: ignore[misc]
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor, dst_type=torch.get_default_dtype())

    def pre_backward(self, tensor: Tensor, module: Any) -> Any:
        # Lightning's runs the Trainer's on_before_backward hooks; Fabric has none here. Fabric's strategy drops
        # what pre_backward returns (its AMP plugin scales in backward): the scaled loss waits for backward here
        if self._fabric is not None:
            self._fabric.ensure_connected()
            self._fabric.scaled_loss = tensor
            return tensor
        return super().pre_backward(tensor, module)  # type: ignore[misc]

    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning's calls LightningModule.backward(tensor, optimizer, ...); Fabric's is tensor.backward(*args)
        if self._fabric is None:
            return super().backward(tensor, model, *args, **kwargs)  # type: ignore[misc]
        scaled, self._fabric.scaled_loss = self._fabric.scaled_loss, None
        (scaled if scaled is not None else tensor).backward(*args, **kwargs)
        return None

    def post_backward(self, tensor: Tensor, module: Any) -> Any:
        # Lightning's runs the Trainer's on_after_backward hooks; Fabric has none here
        return tensor if self._fabric is not None else super().post_backward(tensor, module)  # type: ignore[misc]

    def unscale_gradients(self: _Driven, optimizer: Optimizer) -> None:
        # fabric.clip_gradients calls this first, so clipping sees true gradients; the step does not unscale twice
        steps = self.steps
        if steps.checking and has_grads(optimizer):
            steps.unscale_once(optimizer)

    def __getstate__(self) -> dict[str, Any]:
        # a copy (pickle, deepcopy) is not driven by the Fabric that drives this plugin
        return {**self.__dict__, "_fabric": None}

    def teardown(self) -> None:
        if self._fabric is not None:
            self._fabric.release()
            self._fabric = None
        super().teardown()  # type: ignore[misc]


#: Raised when a second model is set up with a plugin that holds the master weights of a first one.
TWO_MODELS_WITH_MASTERS = (
    "MixedPrecisionPlugin with master weights holds the masters of one model, and this Fabric already set one up. "
    "Set up one model per Fabric with master weights (wrap several networks in one nn.Module and set that up once), "
    "or use master_weights=False."
)

#: Raised when lean masters meet a Fabric ``ModelParallelStrategy`` whose module is not sharded yet.
LEAN_FSDP2_ORDER = (
    "MixedPrecisionPlugin(master_weights='remainder') with Fabric's ModelParallelStrategy splits FSDP2's bf16 shards "
    "into weights and remainders when fabric.setup_module runs, but the model is not sharded yet (Fabric calls "
    "parallelize_fn after the plugin). Shard it first: fabric.launch(); plugin.fsdp2_shard(model, blocks, "
    "mesh=fabric.strategy.device_mesh['data_parallel']); model = fabric.setup_module(model), with "
    "ModelParallelStrategy(parallelize_fn=lambda model, mesh: model). Or use master_weights=True (FSDP2's fp32 "
    "shards are the masters; sharding in parallelize_fn works)."
)


def refuse_lean_fsdp2_before_sharding(plugin: DrivenPlugin, strategy: Any, module: Module) -> None:
    """Raise :data:`LEAN_FSDP2_ORDER` for lean masters under Fabric's FSDP2 when ``module`` has no FSDP2 module."""
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule

    lean = plugin.steps.weights.lean
    if (
        lean
        and lightning_isinstance(strategy, ModelParallelStrategy)
        and not any(isinstance(m, FSDPModule) for m in module.modules())
    ):
        raise ValueError(LEAN_FSDP2_ORDER)
