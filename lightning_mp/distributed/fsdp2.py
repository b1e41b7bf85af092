"""FSDP2 (``fully_shard`` under Lightning's ``ModelParallelStrategy``): the matching policy, agreed skips.

FSDP2 owns parameter storage: each rank holds an fp32 shard of every parameter (a ``DTensor``), all-gathers it in
``MixedPrecisionPolicy.param_dtype`` for compute and reduce-scatters gradients in ``reduce_dtype`` back into fp32
shards. With ``param_dtype`` half those fp32 shards *are* sharded master weights, so ``master_weights=True`` here
means that policy, and the plugin builds no masters of its own (it casts nothing, swaps nothing in the optimizer).
``master_weights="remainder"`` uses the same policy and makes the shards bf16 plus remainders
(:mod:`~lightning_mp.distributed.fsdp2_lean`).
:func:`mixed_precision_policy` (``plugin.fsdp2_policy(...)``) gives the policy that matches the plugin, so
``configure_model`` does not restate dtypes.

The loss scaler unscales the local shards of the gradients (no DTensor dispatch: no hidden collective, no
per-step warnings about its one-element tensors) and the found-inf flag is then summed over all ranks, so an inf
in one rank's shard makes every rank skip. Clipping by norm runs on the DTensor gradients, whose norm torch
reduces over the whole model; names of non-finite gradients at ``min_scale`` are gathered from every rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn import Module

from lightning_mp.distributed import fsdp2_in_backward
from lightning_mp.distributed.fsdp2_lean import ShardedRemainderMasters
from lightning_mp.distributed.shard import fsdp_param_groups
from lightning_mp.distributed.sync import PluginDtypes, ProcessGroupSync, StrategyPlugin
from lightning_mp.master.plain import StrategyMasters


def mixed_precision_policy(plugin: PluginDtypes, name: str = "", module: Optional[Module] = None) -> Any:
    """The ``torch.distributed.fsdp.MixedPrecisionPolicy`` that matches ``plugin``, for ``fully_shard``.

    - ``master_weights=True`` or ``"remainder"``: ``param_dtype`` is the plugin's half dtype (compute in half; fp32
      sharded masters, or bf16 shards + remainders), except for a ``module`` (qualified ``name``) that the plugin keeps
      in fp32 (its policy's ``fp32_modules``, ``keeps_fp32()``, and normalisation layers when ``keep_norm_fp32``):
      ``param_dtype=torch.float32``, inputs cast to fp32. Shard such modules on their own with this policy, before
      their parent.
    - ``master_weights=False``: ``param_dtype=None`` (fp32 parameters; autocast casts per op, as on one device).
    - ``reduce_dtype`` is the plugin's (fp32 by default); ``output_dtype`` is left alone.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    param_dtype: Optional[torch.dtype] = None
    if plugin.master_weights:
        keep = module is not None and plugin.params_stay_fp32(name, module)
        param_dtype = torch.float32 if keep else plugin.dtype
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=plugin.reduce_dtype, cast_forward_inputs=True)


def compute_dtypes(model: Module) -> dict[int, torch.dtype]:
    """``id(parameter) -> dtype FSDP2 computes it in`` for every parameter managed by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    dtypes: dict[int, torch.dtype] = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in fsdp_param_groups(module):
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                dtypes[id(param)] = group.mp_policy.param_dtype or param.dtype
    return dtypes


class FSDP2Sync(ProcessGroupSync):
    """The plugin's side of FSDP2: FSDP2 keeps the masters (or, with lean masters, the plugin keeps remainders of
    its bf16 shards); skips are agreed over all ranks.

    Args:
        strategy: Lightning's ``ModelParallelStrategy`` (its root device is read).
        lean: the plugin has ``master_weights="remainder"``: its store is made sharded
            (:class:`~lightning_mp.distributed.fsdp2_lean.ShardedRemainderMasters`) and converts the shards.
    """

    def __init__(self, strategy: Any, lean: bool = False) -> None:
        super().__init__(strategy.root_device)
        self.owns_masters = not lean
        self.whole_checkpoints = not getattr(strategy, "_save_distributed_checkpoint", True)

    def adopt(self, masters: Any) -> Any:
        if masters is None or isinstance(masters, (ShardedRemainderMasters, StrategyMasters)):
            return masters
        if self.owns_masters:  # the sharded fp32 parameters are the masters: the plugin holds none of its own
            return StrategyMasters(masters)
        sharded = ShardedRemainderMasters.like(masters)
        sharded.whole_checkpoints = self.whole_checkpoints  # read by the generic path (fsdp2_generic)
        return sharded

    def hand_over(self, in_backward: Any) -> None:
        # a step inside backward made after connect (an optimizer swapped mid-fit): its skips agreed per shard too
        fsdp2_in_backward.register(in_backward, self.device, self.group)

    def connect(self, model: Module, plugin: StrategyPlugin) -> None:
        if not plugin.master_weights:
            return
        if plugin.steps.in_backward is not None:  # the step inside backward: skips agreed per shard
            fsdp2_in_backward.register(plugin.steps.in_backward, self.device, self.group)
        dtypes = compute_dtypes(model)
        if not dtypes:
            raise ValueError(
                "MixedPrecisionPlugin(master_weights=True) under ModelParallelStrategy means FSDP2's sharded fp32 "
                "parameters with half-precision compute, but no module of the model was sharded with fully_shard. "
                "In configure_model call fully_shard(module, mesh=self.device_mesh['data_parallel'], "
                "mp_policy=self.trainer.precision_plugin.fsdp2_policy()) (and on the root), or use "
                "master_weights=False."
            )
        wrong: list[str] = []
        norms_in_half: list[str] = []
        for module_name, module in model.named_modules():
            keep = plugin.params_stay_fp32(module_name, module)
            policy_keeps = plugin.keeps_fp32(module_name, module)
            for param_name, param in module.named_parameters(recurse=False):
                dtype = dtypes.get(id(param))
                qualified = f"{module_name}.{param_name}" if module_name else param_name
                if dtype is None or not param.requires_grad:
                    continue
                if keep and dtype != torch.float32:
                    (wrong if policy_keeps else norms_in_half).append(f"{qualified} ({dtype}, want torch.float32)")
                elif not keep and dtype != plugin.dtype:
                    wrong.append(f"{qualified} ({dtype}, want {plugin.dtype})")
        if wrong:
            shown = ", ".join(wrong[:10]) + (f", ... ({len(wrong)} in all)" if len(wrong) > 10 else "")
            raise ValueError(
                f"MixedPrecisionPlugin(precision={plugin.precision!r}, master_weights=True) under FSDP2: these "
                f"parameters are computed in another dtype than the plugin's settings ask: {shown}. Shard with "
                "the plugin's policy: fully_shard(module, mp_policy=plugin.fsdp2_policy(name, module)), where "
                "modules the plugin keeps in fp32 are sharded on their own, before their parent."
            )
        if norms_in_half:
            rank_zero_warn(
                f"MixedPrecisionPlugin(keep_norm_fp32=True) under FSDP2: {len(norms_in_half)} normalisation-layer "
                f"parameters compute in {plugin.dtype} because their module is sharded with its parent "
                f"({norms_in_half[0]}, ...). Their exact fp32 values are still kept (fp32 shards, or with "
                "master_weights='remainder' bf16 shards + remainders). To compute them in fp32, "
                "shard each norm on its own with fully_shard(norm, mp_policy=plugin.fsdp2_policy(name, norm)), or "
                "pass keep_norm_fp32=False to silence this."
            )
