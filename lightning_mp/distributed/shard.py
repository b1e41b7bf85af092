"""FSDP2 in one call: fp8 conversion, then ``fully_shard`` with the plugin's policies, in the order FSDP2 needs.

``plugin.fsdp2_shard(self, blocks=self.model.layers, root=self.model)`` in ``configure_model`` does what a user
otherwise writes by hand:

1. with ``fp8=``, convert the eligible layers (:meth:`~lightning_mp.MixedPrecisionPlugin.fp8_convert`): FSDP2 keeps
   the modules it shards and torchao's fp8 all-gather wraps the weights before they are sharded, so conversion
   cannot come later;
2. with master weights, shard every module the plugin keeps in fp32 (its policy's ``fp32_modules``, norms with
   ``keep_norm_fp32``) on its own with an fp32 policy, innermost first;
3. shard each of ``blocks`` (e.g. the transformer layers) with the plugin's policy;
4. shard the root (the network ``training_step`` calls).

Why the plugin cannot do step 1 by itself in Lightning 2.6: ``configure_model`` (where users call ``fully_shard``)
runs before the precision plugin's ``convert_module``, and the plugin's ``module_init_context`` around it is entered
without the model. torchao's ``convert_to_float8_training`` on an already sharded model swaps in new modules, while
FSDP2 keeps gathering the parameters into the old ones: the first forward fails with ``aten.mm.default got mixed
torch.Tensor and DTensor``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from torch.nn import Module

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from lightning_mp.distributed.sync import PluginDtypes, StrategyPlugin


def fsdp2_shard(
    plugin: StrategyPlugin,
    module: Module,
    blocks: Iterable[Module] = (),
    root: Optional[Module] = None,
    mesh: Any = None,
    **kwargs: Any,
) -> Module:
    """Convert ``module``'s fp8 layers (with ``fp8=``) and shard ``root`` with FSDP2's ``fully_shard``; returns
    ``module``.

    Args:
        plugin: the :class:`~lightning_mp.MixedPrecisionPlugin`.
        module: the LightningModule (``self`` in ``configure_model``): layer names, for the policy's rules and the
            fp8 table, are qualified from it, as in the plugin's own setup.
        blocks: submodules to shard one by one before the root (e.g. ``self.model.layers``), so that one block's
            parameters are gathered at a time; empty (default): the root is one FSDP2 group.
        root: the module to shard last, whose ``forward`` your ``training_step`` calls (e.g. ``self.model``; FSDP2
            gathers the root's own parameters in its forward); default ``module``.
        mesh: the device mesh; default the LightningModule's ``device_mesh["data_parallel"]``.
        kwargs: passed to every ``fully_shard`` call (e.g. ``reshard_after_forward``).

    Raises:
        ValueError: ``root`` not ``module`` or one of its submodules, a block not inside ``root``, or no ``mesh``
            when ``module`` has none.
    """
    from torch.distributed.fsdp import fully_shard

    root = module if root is None else root
    names = {id(sub): name for name, sub in module.named_modules()}
    if id(root) not in names:
        raise ValueError(
            f"fsdp2_shard(root=...): the {type(root).__name__} is not {type(module).__name__} or one of its "
            "submodules; pass the network your training_step calls (e.g. root=self.model)."
        )
    prefix = f"{names[id(root)]}." if names[id(root)] else ""
    blocks = list(blocks)
    strangers = [type(b).__name__ for b in blocks if b is root or not names.get(id(b), "").startswith(prefix)]
    if strangers:
        raise ValueError(
            f"fsdp2_shard(blocks=...): {strangers} are not submodules of the root {type(root).__name__}; pass its "
            "own layers (e.g. blocks=self.model.layers), or no blocks to shard the root as one group."
        )
    if mesh is None:
        mesh = _data_parallel_mesh(module)
    if plugin.fp8 is not None:
        plugin.fp8_convert(module)
    else:
        plugin.resolve_policy(module)  # the module's configure_precision_policy() decides what stays fp32
    kept = _outermost(root, prefix, plugin) if plugin.master_weights else []
    for name, sub in kept:  # fp32 modules get fp32 compute only in a group of their own
        fully_shard(sub, mesh=mesh, mp_policy=plugin.fsdp2_policy(name, sub), **kwargs)
    grouped = [name for name, _ in kept]
    order = dict.fromkeys(names[id(block)] for block in blocks)  # as given (the same on every rank), inner first
    for name in sorted(order, key=lambda name: -name.count(".")):
        if not any(name == outer or name.startswith(f"{outer}.") for outer in grouped):
            fully_shard(module.get_submodule(name), mesh=mesh, mp_policy=plugin.fsdp2_policy(name), **kwargs)
    fully_shard(root, mesh=mesh, mp_policy=plugin.fsdp2_policy(), **kwargs)
    return module


def _outermost(root: Module, prefix: str, plugin: PluginDtypes) -> list[tuple[str, Module]]:
    """Submodules of ``root`` with parameters that the plugin keeps in fp32, not inside another one, innermost
    first; names qualified with ``prefix`` (the root's name in the LightningModule)."""
    kept: list[tuple[str, Module]] = []
    for name, sub in root.named_modules(prefix=prefix.rstrip(".")):
        inside = any(name.startswith(f"{outer}.") for outer, _ in kept)
        has_params = any(True for _ in sub.parameters())
        if sub is not root and not inside and has_params and plugin.params_stay_fp32(name, sub):
            kept.append((name, sub))
    return kept[::-1]


def _data_parallel_mesh(module: Module) -> Any:
    mesh: Optional[Any] = getattr(module, "device_mesh", None)
    if mesh is None:
        raise ValueError(
            f"fsdp2_shard(): {type(module).__name__} has no device_mesh (a LightningModule gets one from "
            "ModelParallelStrategy before configure_model); pass mesh= (e.g. init_device_mesh('cpu', (2,)))."
        )
    return mesh["data_parallel"] if "data_parallel" in (mesh.mesh_dim_names or ()) else mesh


def fsdp_param_groups(module: FSDPModule) -> list[Any]:
    """The ``FSDPParamGroup``s of a ``fully_shard``-ed module: torch >= 2.12 keeps a list (``_fsdp_param_groups``),
    earlier versions one group or ``None`` (``_fsdp_param_group``; the GPU machines' torch 2.11)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        single = getattr(state, "_fsdp_param_group", None)
        groups = [single] if single is not None else []
    return list(groups)
