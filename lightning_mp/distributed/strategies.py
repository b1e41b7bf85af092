"""Which Lightning strategy the plugin runs under, and the :class:`GradientSync` that serves it.

=====================================  ===========================================================================
strategy                               what the plugin does
=====================================  ===========================================================================
``SingleDeviceStrategy``               nothing more (:class:`~lightning_mp.distributed.sync.GradientSync`)
``DDPStrategy`` (``ddp``,              agreed skips; with masters, fp32 master gradients reduced once per step
``ddp_spawn``, ``ddp_fork``, ...)      (:class:`~lightning_mp.distributed.ddp.DDPSync`)
``ModelParallelStrategy`` (FSDP2)      agreed skips; FSDP2's sharded fp32 parameters are the masters, or
                                       bf16 shards + remainders (:class:`~lightning_mp.distributed.fsdp2.FSDP2Sync`)
``DeepSpeedStrategy``                  refused: DeepSpeed has its own scaler and masters (:mod:`.deepspeed`)
``FSDPStrategy`` (FSDP1)               refused: see :mod:`.fsdp1`
other parallel strategies              agreed skips over the default process group; master weights refused
=====================================  ===========================================================================
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric import strategies as fabric
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    SingleDeviceStrategy,
)

from lightning_mp.distributed.ddp import DDPSync
from lightning_mp.distributed.deepspeed import refuse_deepspeed
from lightning_mp.distributed.fsdp1 import refuse_fsdp1
from lightning_mp.distributed.fsdp2 import FSDP2Sync
from lightning_mp.distributed.sync import GradientSync, ProcessGroupSync, StrategyPlugin
from lightning_mp.standalone import lightning_isinstance

#: Strategies under which ``master_weights=True`` is supported.
MASTER_WEIGHTS_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
# Fabric's strategies of the same names are other classes (lightning.fabric.strategies): each pair is one case; the
# standalone packages' copies (pytorch_lightning, lightning_fabric) count as the same (lightning_isinstance)
_SINGLE = (SingleDeviceStrategy, fabric.SingleDeviceStrategy)
_DDP = (DDPStrategy, fabric.DDPStrategy)
_FSDP2 = (ModelParallelStrategy, fabric.ModelParallelStrategy)
_KNOWN = _SINGLE + _DDP + _FSDP2


def sync_for(strategy: Any, plugin: StrategyPlugin) -> GradientSync:
    """The :class:`GradientSync` for ``strategy``, a Trainer's or a Fabric's (``None``: the plugin is used alone).

    Raises:
        ValueError: DeepSpeed or FSDP1 (with what to use instead), or ``master_weights=True`` under a strategy
            not in :data:`MASTER_WEIGHTS_STRATEGIES`.
    """
    if strategy is None:
        return GradientSync()
    if lightning_isinstance(strategy, (DeepSpeedStrategy, fabric.DeepSpeedStrategy)):
        refuse_deepspeed(strategy)
    if lightning_isinstance(strategy, (FSDPStrategy, fabric.FSDPStrategy)):
        refuse_fsdp1(strategy)
    known = lightning_isinstance(strategy, _KNOWN) and type(strategy).__name__ not in _NOT_DDP
    if plugin.master_weights and not known:
        supported = ", ".join(cls.__name__ for cls in MASTER_WEIGHTS_STRATEGIES)
        raise ValueError(
            f"master_weights=True does not support the {type(strategy).__name__} strategy (supported: {supported}). "
            "Use one of those, or master_weights=False."
        )
    if lightning_isinstance(strategy, _FSDP2):
        return FSDP2Sync(strategy, lean=plugin.steps.weights.lean)
    if known and lightning_isinstance(strategy, _DDP):
        return DDPSync(strategy, plugin.reduce_dtype)
    if lightning_isinstance(strategy, (ParallelStrategy, fabric.ParallelStrategy)):
        return ProcessGroupSync(strategy.root_device)
    return GradientSync()


# DDPStrategy subclasses that are not DDP underneath (DeepSpeed is refused before this is read)
_NOT_DDP = {"XLAStrategy"}


def end_distributed_run(trainer: Any) -> None:
    """Both ranks done, the process group down, and (on the launching rank, which hosts the rendezvous store) the
    ranks it launched exited, before this process exits: exiting first can abort it ("terminate called ...")."""
    if trainer is None:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    for child in getattr(getattr(trainer.strategy, "launcher", None), "procs", []):
        child.wait()
