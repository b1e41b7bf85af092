"""FSDP1 (Lightning's ``FSDPStrategy``, ``strategy="fsdp"``): refused, with what to use instead.

Why not a variant of the plugin: Lightning's ``FSDPStrategy`` accepts only an ``FSDPPrecision`` (its
``precision_plugin`` setter raises ``TypeError`` inside ``Trainer(...)``, before any plugin code runs), builds
``FullyShardedDataParallel`` with ``device_id=root_device.index`` and refuses any accelerator but CUDA, so an
``FSDPPrecision``-compatible variant could not be run, let alone tested, on the CPU-only machines this project was
built on. FSDP2 (``ModelParallelStrategy`` + ``fully_shard``) gives the same sharding with loss scaling, sharded fp32
master weights and whole-model norm clipping, and is tested here on 2 CPU processes. This error is raised wherever
the plugin meets an ``FSDPStrategy`` (the CLI checks before it builds the Trainer).
"""

from __future__ import annotations

from typing import Any

#: The message raised when :class:`~lightning_mp.MixedPrecisionPlugin` meets Lightning's FSDP1 strategy.
FSDP1_REFUSAL = (
    "MixedPrecisionPlugin does not support the strategy {strategy}, Lightning's FSDPStrategy (FSDP1), which takes only "
    "its own FSDPPrecision plugin. Use FSDP2 instead, which the plugin supports with loss scaling, sharded fp32 "
    "master weights and whole-model norm clipping:\n"
    "  Trainer(strategy=ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1), "
    "plugins=[MixedPrecisionPlugin(...)])\n"
    "  and in LightningModule.configure_model(): policy = self.trainer.precision_plugin.fsdp2_policy(); "
    "fully_shard(block, mesh=self.device_mesh['data_parallel'], mp_policy=policy) for each block, then the same "
    "for the root module (the documentation's Many devices page, section FSDP2, shows it whole).\n"
    "Or use strategy='ddp' with the plugin, or keep strategy='fsdp' with Lightning's own precision='16-mixed' "
    "(FSDPPrecision, torch's ShardedGradScaler) and without this plugin."
)


def refuse_fsdp1(strategy: Any) -> None:
    """Raise the :data:`FSDP1_REFUSAL` error for ``strategy`` (an ``FSDPStrategy`` or its name).

    Raises:
        ValueError: always.
    """
    name = repr(strategy) if isinstance(strategy, str) else type(strategy).__name__
    raise ValueError(FSDP1_REFUSAL.format(strategy=name))
