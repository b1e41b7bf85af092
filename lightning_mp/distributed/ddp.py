"""DDP (``strategy="ddp"``, ``"ddp_spawn"``, ...): agreed skips, fp32 master gradients reduced once per step.

Without master weights the model is fp32 and DDP all-reduces its fp32 gradients as usual; ``reduce_dtype`` fp16 or
bf16 swaps in torch's compression hook. The skip decision is agreed over the process group
(:class:`~lightning_mp.distributed.sync.ProcessGroupSync`).

With master weights the model is half precision, so DDP's buckets would hold half gradients, and under ``no_sync``
(gradient accumulation) DDP reduces only what the parameters hold on the last micro-batch. Our half gradients move
into the fp32 masters after every backward, so DDP would reduce nothing useful. Instead, as Megatron does with its
contiguous gradient buffer:

- a DDP communication hook passes the half buckets through unreduced (no communication) and notes that DDP wanted
  to synchronise this backward; buckets of parameters kept in fp32 (norms) are reduced as DDP would;
- every backward adds the local half gradients into the fp32 master gradients (the flat buffer), micro-batch
  after micro-batch;
- after the backward on which DDP would have synchronised, the flat fp32 master-gradient buffer is all-reduced
  once (in ``reduce_dtype``, fp32 by default) and divided by the world size.

The result is the mean over all ranks and micro-batches of fp32-accumulated gradients: what one process with the
whole global batch computes. Cost: one all-reduce of 4 bytes per parameter per optimizer step (DDP alone moves 2
bytes of half gradients), not overlapped with the backward; ``reduce_dtype=torch.bfloat16`` halves the bytes.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations against the real classes
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_mp.distributed.sync import ProcessGroupSync, world_size


class DDPSync(ProcessGroupSync):
    """The plugin's side of a DDP strategy: comm hooks, the masters' gradient reduction, agreed skips.

    Args:
        strategy: Lightning's ``DDPStrategy`` (its root device and any user communication hook are read, not kept).
        reduce_dtype: dtype of the gradient all-reduce (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, strategy: Any, reduce_dtype: torch.dtype) -> None:
        super().__init__(strategy.root_device)
        self.user_hook = getattr(strategy, "_ddp_comm_hook", None)  # DDPStrategy(ddp_comm_hook=...)
        self.reduce_dtype = reduce_dtype
        self._masters: Any = None
        self._hook_state: Optional[_HookState] = None

    def connect(self, model: Module, plugin: Any) -> None:
        if not isinstance(model, DistributedDataParallel):
            return  # validate / test / predict: Lightning does not wrap, there are no gradients to reduce
        self.group = model.process_group
        masters = plugin.masters if plugin.master_weights else None
        if getattr(masters, "kind", None) == "remainder":
            # lean masters: DDP broadcast rank 0's bf16 halves when it wrapped the model, the remainders were made
            # from each rank's own values: take rank 0's whole exact values. Then DDP reduces the bf16 gradient
            # buckets itself, overlapped with the backward, in reduce_dtype through the hook below
            _refuse_fp32_accumulation(masters, getattr(model.module, "_trainer", None))
            _broadcast_flats(masters.flat_buffers, self.group)
            masters = None
        elif masters is None and self.reduce_dtype == torch.float32:
            return  # fp32 model: DDP's own fp32 all-reduce is the one we want
        user_hook = self.user_hook
        if user_hook is not None:
            raise ValueError(
                f"DDPStrategy(ddp_comm_hook={getattr(user_hook, '__name__', user_hook)!r}) cannot be combined with "
                f"MixedPrecisionPlugin(master_weights={masters is not None}, reduce_dtype={self.reduce_dtype}): the "
                "plugin registers its own communication hook there (DDP takes one). Drop ddp_comm_hook, or use "
                "master_weights=False with reduce_dtype=torch.float32."
            )
        state = _HookState(self.group, masters.dtype if masters is not None else None, self.reduce_dtype)
        model.register_comm_hook(state, _reduce_hook)
        if masters is None:
            return
        self._masters = masters
        self._hook_state = state
        # DDP broadcast rank 0's half parameters when it wrapped the model; the masters were built from each rank's
        # own fp32 values, so they take rank 0's too (once, at setup)
        src = torch.distributed.get_global_rank(self.group, 0) if self.group is not None else 0
        for flat, _ in masters.flat_buffers:
            torch.distributed.broadcast(flat, src=src, group=self.group)

    def after_backward(self) -> None:
        if self._hook_state is None or not self._hook_state.synced:
            return  # no masters, or a no_sync micro-batch: the gradients stay local for now
        self._hook_state.synced = False
        self._masters.ensure_grads()
        for _, flat_grad in self._masters.flat_buffers:
            all_reduce_mean(flat_grad, self.reduce_dtype, self.group)

    def __repr__(self) -> str:
        mode = "master gradients reduced by the plugin" if self._hook_state is not None else "DDP reduces"
        return f"{type(self).__name__}(world_size={world_size(self.group)}, reduce_dtype={self.reduce_dtype}, {mode})"


def _refuse_fp32_accumulation(masters: Any, trainer: Any) -> None:
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate > 1 and masters.accumulate_grads_in == torch.float32:
        raise ValueError(
            f"master_weights='remainder' with accumulate_grad_batches={accumulate} under DDP: fp32 accumulation makes "
            "the gradients of the bf16 parameters fp32 between micro-batches, and DDP's buckets (bf16, built from the "
            "parameters) cannot reduce them. Use master_weights={'kind': 'remainder', 'accumulate_grads_in': 'bf16'} "
            "(DDP reduces the bf16 sums), or master_weights=True (fp32 masters: exact fp32 accumulation under DDP)."
        )


def _broadcast_flats(flats: list[tuple[Tensor, Tensor]], group: Any) -> None:
    src = torch.distributed.get_global_rank(group, 0) if group is not None else 0
    for high, low in flats:
        for tensor in (high, low):  # as bytes: gloo need not know bf16 or int16
            torch.distributed.broadcast(tensor.view(torch.uint8), src=src, group=group)


def all_reduce_mean(tensor: Tensor, reduce_dtype: torch.dtype, group: Optional[Any] = None) -> None:
    """Replace ``tensor`` by its mean over ``group``, communicated in ``reduce_dtype`` (divided before a half
    all-reduce, so that the sum cannot overflow where the mean would not)."""
    size = world_size(group)
    if reduce_dtype == tensor.dtype:
        torch.distributed.all_reduce(tensor, group=group)
        tensor.div_(size)
        return
    sent = tensor.div(size).to(reduce_dtype)
    torch.distributed.all_reduce(sent, group=group)
    tensor.copy_(sent)


class _HookState:
    """What the communication hook needs, and what it tells us: whether DDP synchronised this backward."""

    def __init__(self, group: Any, deferred_dtype: Optional[torch.dtype], reduce_dtype: torch.dtype) -> None:
        self.group = group
        self.deferred_dtype = deferred_dtype  # buckets of this dtype (the half parameters with masters) stay local
        self.reduce_dtype = reduce_dtype
        self.synced = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "group": None}  # a process group does not pickle


def _reduce_hook(state: _HookState, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's bucket all-reduce (mean), in ``state.reduce_dtype``; buckets of ``state.deferred_dtype`` untouched.

    torch's own ``bf16_compress_hook`` refuses anything but NCCL, so the cast is done here (as its hooks do:
    divide, cast, all-reduce, copy back).
    """
    buffer = bucket.buffer()
    if buffer.dtype == state.deferred_dtype:
        # half gradients of parameters with masters: no communication now; the flat fp32 master buffer is reduced
        # after this backward (DDPSync.after_backward)
        state.synced = True
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done
    sent = (
        buffer.div_(world_size(state.group))
        if state.reduce_dtype == buffer.dtype
        else (buffer.div(world_size(state.group)).to(state.reduce_dtype))
    )
    future = torch.distributed.all_reduce(sent, group=state.group, async_op=True).get_future()

    def copy_back(fut: torch.futures.Future[Any]) -> torch.Tensor:
        return buffer.copy_(fut.value()[0]) if sent is not buffer else buffer

    return future.then(copy_back)
