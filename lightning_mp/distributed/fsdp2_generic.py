"""Any optimizer on lean master weights under FSDP2: the generic chunked path on whole local shards.

:class:`~lightning_mp.master.lean.generic.GenericChunkedStep` runs the optimizer's own ``step()`` on fp32 *proxy*
parameters. Under FSDP2 (:class:`~lightning_mp.distributed.fsdp2_lean.ShardedRemainderMasters`) each proxy is one
whole parameter, a ``DTensor`` sharded like it (same mesh, placements, global shape and stride) whose local tensor
is, during a step, this rank's exact fp32 shard (bf16 shard joined with its remainder in the staging buffer; for a
parameter kept in fp32, the parameter's own local shard) and, between steps, a zero-stride placeholder. So:

- the optimizer makes its state as it does for FSDP2's own fp32 ``DTensor`` parameters (torchao's ``AdamW8bit``
  / ``AdamW4bit``: quantised local shards wrapped in ``DTensor`` s; torch's for-loop optimizers: ``DTensor``
  buffers), keyed by the proxies;
- ``optimizer.state_dict()`` / ``load_state_dict()`` see the proxies, one per model parameter in the same order,
  so torch's distributed checkpoint (``get_optimizer_state_dict`` / ``set_optimizer_state_dict``, which Lightning's
  ``ModelParallelStrategy`` uses) maps each proxy's state to the model parameter's name and saves each rank's
  shard of it;
- a step the optimizer is asked for outside the plugin (torch's ``_init_optim_state``, which makes the state of an
  empty optimizer before a distributed checkpoint is loaded into it, with zero gradients and ``lr`` 0) goes through
  the same proxies, so that state is made as the plugin's steps make it, not on the bf16 parameters.

Exactness: as :mod:`lightning_mp.master.lean.generic` (the optimizer's own update of fp32 shards holding the exact
values; an optimizer that treats elements independently gives what it gives on FSDP2's fp32 shards). Transient
memory: a proxy is a whole local shard, so a step stages ``max(chunk_size, largest local shard)`` fp32 values and
gradients (8 bytes each), not more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, cast

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.master.lean.chunked import local_of
from lightning_mp.master.lean.generic import GenericChunkedStep, Slice, placeholder
from lightning_mp.master.lean.interface import LeanStore

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def check_sharded_params(optimizer: Optimizer) -> None:
    """Raise a ValueError naming the first parameter of ``optimizer`` that is not sharded by ``fully_shard`` (a plain
    tensor): its state would be one rank's, and its gradient is not reduced."""
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if not hasattr(param, "device_mesh"):
                raise ValueError(
                    f"master_weights='remainder' under FSDP2 needs every parameter of {type(optimizer).__name__} "
                    f"sharded by fully_shard, but param_groups[{g}]['params'][{i}] (shape {tuple(param.shape)}) "
                    "is a plain tensor. Shard the whole model (fully_shard on the root too)."
                )


def check_sharded_state(optimizer: Optimizer, store: LeanStore) -> None:
    """Refuse ``optimizer``'s state that a checkpoint would save wrongly, as soon as it exists (after the first step
    here, at setup for torchao's 8-bit Adam in one pass, or at a save):

    - a per-parameter tensor that is not a ``DTensor`` (made from the local shard's shape, say): a distributed
      checkpoint would save one rank's for all; only 0-dim tensors (step counters, equal on every rank) may be
      plain;
    - with whole-file checkpoints (``save_distributed_checkpoint=False``, ``store.whole_checkpoints``), a
      tensor-subclass local shard (torchao's quantised states): torch cannot gather it into a tensor it can save and
      load."""
    whole = getattr(store, "whole_checkpoints", False)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor) and value.dim() > 0 and not hasattr(value, "device_mesh"):
                raise ValueError(
                    f"master_weights='remainder' under FSDP2: {type(optimizer).__name__}'s state {key!r} is "
                    f"a plain tensor of shape {tuple(value.shape)}, not a DTensor sharded like its parameter, so a "
                    "distributed checkpoint would save one rank's values for every rank. Use an optimizer that "
                    "makes its state like its parameters (torch.zeros_like(param)), or master_weights=True under "
                    "FSDP2."
                )
            if whole and isinstance(value, Tensor) and type(local_of(value)) is not Tensor:
                raise ValueError(
                    "master_weights='remainder' under FSDP2 with ModelParallelStrategy(save_distributed_checkpoint"
                    f"=False): {type(optimizer).__name__}'s state {key!r} is a tensor subclass "
                    f"({type(local_of(value)).__name__}), which torch cannot gather into a whole-file checkpoint "
                    "(the file would hold unfinished collectives and not load). Keep save_distributed_checkpoint"
                    "=True (the default: each rank saves its shards; `python -m lightning_mp consolidate` makes one fp32 "
                    "weights file of them), or use an optimizer whose state is plain tensors."
                )


class _ShardSlice(Slice):
    """This rank's whole local shard of ``param``; the proxy is a ``DTensor`` sharded like ``param``."""

    def __init__(self, param: Tensor) -> None:
        local = local_of(param)
        self.param, self.start, self.end, self.shape = param, 0, local.numel(), tuple(local.shape)
        self.proxy = nn.Parameter(
            _like(param, placeholder(self.shape, local.device)), requires_grad=param.requires_grad
        )

    def point(self, values: Tensor, grad: Optional[Tensor] = None) -> None:
        """Make the proxy (same object) a ``DTensor`` whose local tensor is ``values`` (and its gradient one whose
        local tensor is ``grad``)."""
        self.proxy.data = _like(self.param, values)
        # `.data` updates the wrapper's metadata, not the Python attribute (the proxy is a DTensor from here on)
        cast("DTensor", self.proxy)._local_tensor = values
        if grad is not None:
            self.proxy.grad = _like(self.param, grad)

    def rest(self) -> None:
        self.point(placeholder(self.shape, local_of(self.param).device))
        self.proxy.grad = None


def _like(param: Tensor, local: Tensor) -> Tensor:
    """A ``DTensor`` sharded like ``param`` (a sharded parameter: FSDP2's are ``DTensor`` s) holding ``local``."""
    from torch.distributed.tensor import DTensor

    sharded = cast(DTensor, param)
    return DTensor.from_local(
        local, sharded.device_mesh, sharded.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


class ShardedGenericStep(GenericChunkedStep):
    """:class:`~lightning_mp.master.lean.generic.GenericChunkedStep` with one ``DTensor`` proxy per sharded parameter
    (see module doc)."""

    def __init__(self, optimizer: Optimizer, store: LeanStore, chunk_size: int) -> None:
        check_sharded_params(optimizer)
        self._inside = False
        super().__init__(optimizer, store, chunk_size)
        self._hooks += [
            optimizer.register_state_dict_pre_hook(lambda opt: self._check_state(), prepend=True),
            optimizer.register_step_pre_hook(self._outside_step),
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_outside_step()),
        ]
        self._outside = False
        self._checked = False

    def _check_state(self) -> None:
        check_sharded_state(self.optimizer, self.store)

    def _slices_for(self, param: Tensor) -> list[Slice]:
        return [_ShardSlice(param)]

    def _values_of(self, s: Slice) -> Tensor:
        return local_of(s.proxy)

    def run(self, found_inf: Optional[Tensor], grad_ops: list[tuple[str, Any]]) -> None:
        self._inside = True
        try:
            super().run(found_inf, grad_ops)
        finally:
            self._inside = False
        if not self._checked and self.optimizer.state:
            self._checked = True
            self._check_state()

    def _outside_step(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """``optimizer.step()`` called by someone else than :meth:`run` (torch's ``_init_optim_state`` before a
        distributed-checkpoint load): run it on the proxies with the model's gradients as they are, then let the
        optimizer's own call step nothing (its groups are empty until the post-hook)."""
        if self._inside:
            return
        self.run(None, [])
        for group in optimizer.param_groups:
            group["params"] = []
        self._outside = True

    def _after_outside_step(self) -> None:
        if self._outside:
            self._outside = False
            self._swap_out_proxies()

    def restore(self) -> None:
        """At teardown: each proxy's state moves to its parameter (a ``DTensor`` sharded like it)."""
        for slices in self.slices:
            for s in slices:
                state = self.optimizer.state.pop(s.proxy, None)
                if state is not None:
                    self.optimizer.state[s.param] = state
        for hook in self._hooks:
            hook.remove()
