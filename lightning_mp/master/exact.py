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

Parameters without masters (kept in fp32, or a model without master weights) are yielded as they are: already exact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor, nn


def store_of(module: Any) -> Any:
    """The master-weights store that holds ``module``'s masters, found through what runs it: a LightningModule's
    Trainer, a Fabric-wrapped module's strategy; ``None`` when no store converted it (no master weights, or after
    teardown: then the parameters are the exact values)."""
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


def _usable(store: Any, module: nn.Module) -> Any:
    store = store if store is not None else store_of(module)
    if getattr(store, "model_sync", None) is None:
        return None
    if hasattr(store, "single_device"):  # lightning_mp.distributed.fsdp2_lean.ShardedRemainderMasters
        raise ValueError(SHARDED)
    return store


def _converted(store: Any, param: Tensor) -> bool:
    return store is not None and store.model_sync is not None and store.model_sync.tracks(param)


def exact_parameters(module: nn.Module, store: Any = None) -> Iterator[tuple[str, Tensor]]:
    """``(name, exact fp32 value)`` for each of ``module``'s parameters, in ``named_parameters()`` order (tied ones
    once), each made when the iteration reaches it. ``store``: the master-weights store (default: found from
    ``module``, see :func:`store_of`). Read the values, do not write them (writes go through :func:`exact_weights`)."""
    store = _usable(store, module)
    inner = unwrap(module)
    if store is not None:
        store.model_sync.follow()  # a write into the model since the last step counts
    for name, param in inner.named_parameters():
        yield name, store.fp32_value(param) if _converted(store, param) else param.detach()


@contextlib.contextmanager
def exact_weights(module: nn.Module, store: Any = None, write: bool = True) -> Iterator[nn.Module]:
    """Inside, ``module``'s parameters are fp32 parameters holding the exact master values (see the module doc).

    Args:
        module: the model (a LightningModule, a Fabric-wrapped or DDP-wrapped module, or a submodule).
        store: the master-weights store (default: found from ``module``, see :func:`store_of`).
        write: ``True`` (default): on leaving, the values in the fp32 parameters become the masters (exactly) and the
            model's 16-bit copy their rounding. ``False``: read only; nothing is written back (with
            ``master_weights=True`` the fp32 parameters are the masters themselves: do not write them then).

    Yields the unwrapped module. Without master weights (or outside fit) nothing changes: the parameters are exact.
    """
    store = _usable(store, module)
    inner = unwrap(module)
    if store is None:
        yield inner
        return
    sync = store.model_sync
    sync.follow()  # writes since the last step reach the masters before they are read
    swapped: list[tuple[dict[str, Any], str, nn.Parameter]] = []
    exact: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(model param) -> (model param, fp32 parameter)
    for owner in inner.modules():
        for name, param in list(owner._parameters.items()):
            if param is None or not _converted(store, param):
                continue
            if id(param) not in exact:  # tied parameters share one fp32 parameter
                exact[id(param)] = (param, _fp32_parameter(store, param))
            swapped.append((owner._parameters, name, param))
            owner._parameters[name] = exact[id(param)][1]
    try:
        with sync.paused():  # the swap is not a write into the model
            yield inner
    finally:
        for slots, name, param in swapped:
            slots[name] = param
        if write:
            _write_back(store, list(exact.values()))
            sync.record()  # the plugin's own writes


def _fp32_parameter(store: Any, param: nn.Parameter) -> nn.Parameter:
    master = store.master_of(param)  # master_weights=True: the master itself (no copy)
    value = master.detach() if master is not None else store.fp32_value(param)
    return nn.Parameter(value, requires_grad=param.requires_grad)


@torch.no_grad()
def _write_back(store: Any, pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> None:
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
