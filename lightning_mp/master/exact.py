"""The exact fp32 weights of a model whose parameters are 16-bit copies of master weights: read them, write them.

With master weights the model's parameters are 16-bit copies; the weights the optimizer trains are the masters
(fp32 tensors, or bf16 weights plus 16-bit remainders). Code that reads ``model.parameters()`` between steps (an EMA
teacher, ``torch.optim.swa_utils.AveragedModel``, Lightning's weight-averaging callbacks, diffusers' ``EMAModel``)
reads the 16-bit copies, and a write through ``param.data.copy_(t)`` reaches no master (see
:mod:`lightning_mp.master.model_sync`). Two ways to the exact values:

- :func:`exact_parameters`: ``(name, fp32 tensor)`` per parameter, one at a time. With ``master_weights=True`` the
  tensor *is* the master (no copy; read it, do not write it); with ``"remainder"`` a fresh fp32 tensor joined from
  the bf16 weight and its remainder (one parameter's worth of memory at a time). For an EMA teacher:
  ``for (name, w), t in zip(exact_parameters(student), teacher.parameters()): t.lerp_(w, 1 - decay)``.
- :func:`exact_weights`: a context inside which ``module.parameters()`` (and ``named_parameters()``, ``get_parameter``)
  yield fp32 parameters holding the exact values, so code written for an fp32 model runs unchanged; on leaving, what
  was written into them (by any means, ``.data.copy_`` included) becomes the masters exactly and the model's 16-bit
  copy their rounding. The model's own parameter objects stay where they are (they are swapped out of the modules'
  ``_parameters`` only, never given another dtype: that would drop their gradient accumulators, which DDP hooks).
  With ``"remainder"`` the fp32 values exist for the whole model while inside (4 bytes per parameter, transient).

Both take any module whose parameters the plugin holds (the LightningModule, a submodule such as a diffusers UNet
inside it, a module reached by any path): the masters are found from the parameters themselves
(:func:`~lightning_mp.master.model_sync.holder_of`). Parameters without masters (kept in fp32, a model without
master weights, after fit) are yielded as they are: they are the exact values. A module the plugin's masters do not
hold, asked through the plugin (or through the Trainer or Fabric that runs it), raises :class:`NotHeldError` naming
it: never its 16-bit values in silence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mp.master.model_sync import MasterStore, ModelSync, holder_of


def store_of(module: Any) -> Any:
    """The master-weights store of the plugin that runs ``module``, found through what runs it: a LightningModule's
    Trainer, a Fabric-wrapped module's strategy; ``None`` when no store converted it (no master weights, or after
    teardown: then the parameters are the exact values). Any other module's masters are found from its parameters
    (:func:`~lightning_mp.master.model_sync.holder_of`)."""
    plugin = None
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        plugin = getattr(trainer, "precision_plugin", None)
    elif getattr(module, "_strategy", None) is not None:  # a _FabricModule
        plugin = getattr(module._strategy, "precision", None)
    store = getattr(plugin, "masters", None)
    return store if getattr(store, "model_sync", None) is not None else None


def unwrap(module: nn.Module) -> nn.Module:
    """The module whose parameters the masters belong to: a Fabric or DDP wrapper's inner module, else itself."""
    module = getattr(module, "_original_module", None) or module  # _FabricModule
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


#: Raised for lean masters under FSDP2, whose remainders are sharded like the parameters.
SHARDED = (
    "lightning_mp.master.exact_parameters / exact_weights read whole parameters, but these lean masters are sharded "
    "by FSDP2 (each rank holds the remainders of its local shards). Read the weights after fit (the model holds its "
    "fp32 values again), or from a checkpoint (its state_dict holds the exact fp32 values), or use "
    "master_weights=True under FSDP2 (the sharded fp32 parameters are the masters: read them as they are)."
)


class NotHeldError(ValueError):
    """The plugin's master weights were asked for the exact weights of a module whose parameters they do not hold."""


def _holders(
    module: nn.Module, store: Optional[object]
) -> tuple[nn.Module, list[tuple[str, nn.Parameter, Optional[ModelSync]]]]:
    """``module`` unwrapped, and ``(name, parameter, the ModelSync holding it or None)`` for each of its parameters
    (tied ones once). Each parameter's masters are found from the parameter itself (:func:`holder_of`), whatever
    path reached the module. ``store``: the master-weights store the caller expects to hold the module (the
    plugin's, for its methods; default: the one that runs ``module``, :func:`store_of`).

    Raises:
        NotHeldError: that store holds none of the module's parameters (the 16-bit copies are never given instead).
        ValueError: lean masters sharded by FSDP2 hold them (:data:`SHARDED`).
    """
    inner = unwrap(module)
    held = [(name, param, holder_of(param)) for name, param in inner.named_parameters()]
    expected = store if store is not None else store_of(module)
    sync = getattr(expected, "model_sync", None)  # None: no masters, not set up yet, or masters that are the params
    if sync is not None and held and not any(holder is sync for _, _, holder in held):
        raise NotHeldError(_not_held(inner, held, expected))
    for _, _, holder in held:
        if holder is not None and hasattr(holder.store, "single_device"):  # fsdp2_lean.ShardedRemainderMasters
            raise ValueError(SHARDED)
    return inner, held


def _not_held(
    inner: nn.Module, held: list[tuple[str, nn.Parameter, Optional[ModelSync]]], store: Optional[object]
) -> str:
    names = ", ".join(name for name, _, _ in held[:3]) + (", ..." if len(held) > 3 else "")
    dtypes = sorted({str(param.dtype).removeprefix("torch.") for _, param, _ in held})
    return (
        f"lightning_mp exact weights: the plugin's master weights ({type(store).__name__}) do not hold "
        f"{type(inner).__name__} (parameters {names}; {'/'.join(dtypes)}): it is not part of the model the plugin set "
        "up, so it has no master weights and the plugin cannot give its exact values. Pass the model the plugin "
        "trains or any of its submodules (the LightningModule, self.unet, the Fabric-wrapped module); a module "
        "trained without master weights holds its exact values itself: read its parameters directly."
    )


def exact_parameters(module: nn.Module, store: Optional[object] = None) -> Iterator[tuple[str, Tensor]]:
    """``(name, exact fp32 value)`` for each of ``module``'s parameters, in ``named_parameters()`` order (tied ones
    once), each made when the iteration reaches it. ``module``: any module whose parameters the plugin holds (the
    LightningModule, a submodule such as ``self.unet``, a Fabric- or DDP-wrapped module): the masters are found from
    the parameters themselves. Parameters without masters (kept in fp32 by the policy, a model trained
    without master weights, after fit) are given as they are: they are the exact values. ``store``: the
    master-weights store expected to hold ``module`` (the plugin's methods pass theirs; default: the one that runs
    ``module``, see :func:`store_of`); a module it does not hold raises :class:`NotHeldError` naming it. Read the
    values, do not write them (writes go through :func:`exact_weights`)."""
    inner, held = _holders(module, store)
    for distinct in _distinct(held):
        distinct.follow()  # a write into the model since the last step counts
    for name, param, sync in held:
        yield name, sync.store.fp32_value(param) if sync is not None and sync.tracks(param) else param.detach()


@contextlib.contextmanager
def exact_weights(module: nn.Module, store: Optional[object] = None, write: bool = True) -> Iterator[nn.Module]:
    """Inside, ``module``'s parameters are fp32 parameters holding the exact master values (see the module doc).

    Args:
        module: any module whose parameters the plugin holds: the LightningModule, a submodule of it (``self.unet``),
            a Fabric-wrapped or DDP-wrapped module; its masters are found from its parameters.
        store: the master-weights store expected to hold ``module`` (default: the one that runs ``module``, see
            :func:`store_of`); a module it does not hold raises :class:`NotHeldError` naming it.
        write: ``True`` (default): on leaving, the values in the fp32 parameters become the masters (exactly) and the
            model's 16-bit copy their rounding. ``False``: read only; nothing is written back (with
            ``master_weights=True`` the fp32 parameters are the masters themselves: do not write them then).

    Yields the unwrapped module. Without master weights (or outside fit) nothing changes: the parameters are exact.
    """
    inner, held = _holders(module, store)
    syncs = _distinct(held)
    if not syncs:
        yield inner
        return
    for sync in syncs:
        sync.follow()  # writes since the last step reach the masters before they are read
    tracked = {id(param): sync for _, param, sync in held if sync is not None and sync.tracks(param)}
    swapped: list[tuple[dict[str, Any], str, nn.Parameter]] = []
    exact: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(model param) -> (model param, fp32 parameter)
    for owner in inner.modules():
        for name, param in list(owner._parameters.items()):
            if param is None or id(param) not in tracked:
                continue
            if id(param) not in exact:  # tied parameters share one fp32 parameter
                exact[id(param)] = (param, _fp32_parameter(tracked[id(param)].store, param))
            swapped.append((owner._parameters, name, param))
            owner._parameters[name] = exact[id(param)][1]
    try:
        with contextlib.ExitStack() as paused:
            for sync in syncs:
                paused.enter_context(sync.paused())  # the swap is not a write into the model
            yield inner
    finally:
        for slots, name, param in swapped:
            slots[name] = param
        if write:
            for sync in syncs:
                _write_back(sync.store, [pair for key, pair in exact.items() if tracked[key] is sync])
                sync.record()  # the plugin's own writes


def _distinct(held: list[tuple[str, nn.Parameter, Optional[ModelSync]]]) -> list[ModelSync]:
    """The master-weights syncs holding these parameters, each once (one, but a module may span two plugins')."""
    syncs: dict[int, ModelSync] = {}
    for _, _, sync in held:
        if sync is not None:
            syncs.setdefault(id(sync), sync)
    return list(syncs.values())


def _fp32_parameter(store: MasterStore, param: nn.Parameter) -> nn.Parameter:
    master = store.master_of(param)  # master_weights=True: the master itself (no copy)
    value = master.detach() if master is not None else store.fp32_value(param)
    return nn.Parameter(value, requires_grad=param.requires_grad)


@torch.no_grad()
def _write_back(store: MasterStore, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
    """The fp32 parameters' values become the masters; the model's 16-bit copies their rounding."""
    halves, masters = [], []
    for param, fp32 in pairs:
        master: Optional[nn.Parameter] = store.master_of(param)
        if master is not None and master.data_ptr() == fp32.data_ptr():  # written in place: only the copy is stale
            halves.append(param.data)
            masters.append(master.detach())
        else:
            store.load_fp32(param, fp32.detach())
    if halves:
        torch._foreach_copy_(halves, masters)
