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

With lean master weights (``master_weights="remainder"``) the model's bf16 parameters are the ones trained, so DDP's
own bucketed all-reduce, overlapped with the backward, reduces their bf16 gradients, through the hook below in
``reduce_dtype``. Accumulating in fp32 (the default, ``accumulate_grads_in=torch.float32``) over several
micro-batches, where fp32 gradients cannot enter DDP's bf16 buckets:

- on ``no_sync`` micro-batches the gradients add up in fp32 as on one device (autograd adds each bf16 gradient
  into the fp32 one; DDP does nothing);
- before the backward on which DDP synchronises, the fp32 sums move aside (:class:`_LeanSums`), so that this
  backward's bf16 gradients go into DDP's buckets;
- the hook adds, per bucket, the fp32 sums of the bucket's parameters to the bucket's bf16 gradients in fp32,
  divides by the world size and all-reduces that in ``reduce_dtype``, keeping the fp32 result;
- right after that backward (before ``on_after_backward`` hooks) the reduced fp32 sums become the gradients.

The step sees the mean over ranks of fp32-accumulated gradients, as with fp32 masters, and the reduction stays
overlapped with the backward: one all-reduce of ``reduce_dtype`` per bucket (4 bytes per parameter in fp32) on the
last micro-batch only. Without accumulation nothing is moved aside: the bucket's mean is rounded back to bf16.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations against the real classes
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from lightning_mp.distributed import ddp_in_backward
from lightning_mp.distributed.sync import ProcessGroupSync, StrategyPlugin, world_size
from lightning_mp.master import MasterWeights, RemainderMasters


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
        self._masters: Optional[MasterWeights] = None  # the flat fp32 masters whose gradients DDP reduces
        self._hook_state: Optional[_HookState] = None
        self._ddp: Optional[DistributedDataParallel] = None
        self._lean: Optional[_LeanSums] = None
        self._updates: Optional[ddp_in_backward.BucketUpdates] = None  # optimizer_in_backward: the comm hook's state

    def connect(self, model: Module, plugin: StrategyPlugin) -> None:
        if not isinstance(model, DistributedDataParallel):
            return  # validate / test / predict: Lightning does not wrap, there are no gradients to reduce
        self.group = model.process_group
        masters = plugin.masters if plugin.master_weights else None
        if isinstance(masters, RemainderMasters):  # lean masters (the stores whose `lean` is set)
            # lean masters: DDP broadcast rank 0's bf16 halves when it wrapped the model, the remainders were made
            # from each rank's own values: take rank 0's whole exact values. Then DDP reduces the bf16 gradient
            # buckets itself, overlapped with the backward, in reduce_dtype through the hook below; fp32 sums of
            # accumulated micro-batches join the last micro-batch's bf16 buckets there (_LeanSums)
            _broadcast_flats(masters.flat_buffers, self.group)
            if masters.accumulate_grads_in == torch.float32:
                lean = [p for p in model.module.parameters() if masters.offset_of(p) is not None]
                self._ddp, self._lean = model, _LeanSums(lean)
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
        # the other store that holds masters: the flat fp32 masters (what masters_for makes of True / "fp32")
        assert masters is None or isinstance(masters, MasterWeights), type(masters)
        state = _HookState(self.group, masters.dtype if masters is not None else None, self.reduce_dtype, self._lean)
        if getattr(plugin, "optimizer_in_backward", False):  # updates after each bucket (its StepInBackward: now or
            # when Fabric sets up the optimizer after the module connected, hand_over)
            self._updates = ddp_in_backward.register(model, _reduce_hook, state, plugin.steps.in_backward, self.device)
        else:
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

    def hand_over(self, in_backward: Any) -> None:
        if self._updates is not None:  # Fabric: an optimizer set up after its DDP module connected
            ddp_in_backward.hand_over(self._updates, in_backward)

    def before_backward(self) -> None:
        if self._masters is not None:  # fp32 masters: DDP's buckets take gradients of the half parameters' dtype
            self._masters.hide_grads()  # only: the model shows the masters' fp32 ones again after the move
        lean = self._lean
        # DDP's forward prepared the reducer for this backward unless it ran under no_sync: only then do the fp32
        # sums have to leave the gradients (on no_sync micro-batches autograd adds into them, as on one device)
        if lean is None or not getattr(self._ddp, "require_forward_param_sync", True):
            return
        for param in lean.params:
            grad = param.grad
            if grad is not None:  # fp32 here: the masters made it fp32 (RemainderMasters.before_backward)
                lean.pending[id(param)] = grad if grad.dtype == torch.float32 else grad.float()
                param.grad = None
        lean.active = bool(lean.pending)

    def backward_finished(self) -> None:
        lean = self._lean
        if lean is None or not lean.active:
            return
        lean.active = False
        reduced, lean.reduced = lean.reduced, []
        for param, value in reduced:
            _set_fp32_grad(param, value)
        if lean.pending:  # moved aside but not reduced (not in a DDP bucket, or no synchronisation after all)
            for param in lean.params:
                pending = lean.pending.pop(id(param), None)
                if pending is not None:
                    _set_fp32_grad(param, pending if param.grad is None else pending.add_(param.grad))

    def after_backward(self) -> None:
        masters = self._masters  # set with the hook's state
        if self._hook_state is None or masters is None or not self._hook_state.synced:
            return  # no masters, or a no_sync micro-batch: the gradients stay local for now
        self._hook_state.synced = False
        masters.ensure_grads()
        for _, flat_grad in masters.flat_buffers:
            all_reduce_mean(flat_grad, self.reduce_dtype, self.group)

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_ddp": None, "_lean": None, "_updates": None}

    def __repr__(self) -> str:
        mode = "master gradients reduced by the plugin" if self._hook_state is not None else "DDP reduces"
        return f"{type(self).__name__}(world_size={world_size(self.group)}, reduce_dtype={self.reduce_dtype}, {mode})"


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


def _set_fp32_grad(param: Tensor, value: Tensor) -> None:
    if param.grad is None:  # a gradient assigned must have its parameter's dtype: a bf16 one, whose data is replaced
        param.grad = torch.empty_like(param)
    param.grad.data = value


class _LeanSums:
    """Lean masters accumulating in fp32 under DDP: the fp32 sums of earlier micro-batches, moved aside before the
    synchronising backward (``pending``), and what the hook made of them (``reduced``: ``(parameter, fp32 mean)``)."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params  # the bf16 parameters with remainders
        self.pending: dict[int, Tensor] = {}
        self.reduced: list[tuple[Tensor, Tensor]] = []
        self.active = False  # sums were moved aside before this backward: its bf16 buckets take them in

    def __getstate__(self) -> dict[str, Any]:
        return {"params": [], "pending": {}, "reduced": [], "active": False}  # tensors of a run: not pickled


class _HookState:
    """What the communication hook needs, and what it tells us: whether DDP synchronised this backward."""

    def __init__(
        self,
        group: Any,
        deferred_dtype: Optional[torch.dtype],
        reduce_dtype: torch.dtype,
        lean: Optional[_LeanSums] = None,
    ) -> None:
        self.group = group
        self.deferred_dtype = deferred_dtype  # buckets of this dtype (the half parameters with masters) stay local
        self.reduce_dtype = reduce_dtype
        self.lean = lean
        self.synced = False

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "group": None}  # a process group does not pickle


def _reduce_hook(state: _HookState, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's bucket all-reduce (mean), in ``state.reduce_dtype``; buckets of ``state.deferred_dtype`` untouched.

    torch's own ``bf16_compress_hook`` refuses anything but NCCL, so the cast is done here (as its hooks do:
    divide, cast, all-reduce, copy back).
    """
    buffer = bucket.buffer()
    if state.lean is not None and state.lean.active and buffer.dtype == torch.bfloat16:
        return _reduce_with_fp32_sums(state, bucket, buffer)
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


def _reduce_with_fp32_sums(
    state: _HookState, bucket: torch.distributed.GradBucket, buffer: Tensor
) -> torch.futures.Future[torch.Tensor]:
    """Lean masters accumulating in fp32: the bucket's bf16 gradients plus its parameters' fp32 sums, in fp32,
    divided by the world size and all-reduced in ``reduce_dtype``; the fp32 result is kept for the step
    (``state.lean.reduced``), the bf16 bucket goes back to DDP as it came (its gradients are replaced)."""
    lean = state.lean
    assert lean is not None
    total = buffer.to(torch.float32)  # a bucket's worth of fp32: the sums of its parameters are released into it
    places, offset = [], 0
    for param in bucket.parameters():  # laid out in this order in the bucket
        numel = param.numel()
        pending = lean.pending.pop(id(param), None)
        if pending is not None:
            total[offset : offset + numel].add_(pending.reshape(-1))  # as autograd adds into an fp32 gradient
        places.append((param, offset, numel))
        offset += numel
    total.div_(world_size(state.group))
    sent = total if state.reduce_dtype == torch.float32 else total.to(state.reduce_dtype)
    future = torch.distributed.all_reduce(sent, group=state.group, async_op=True).get_future()

    def keep(fut: torch.futures.Future[Any]) -> torch.Tensor:
        value = fut.value()[0]
        value = value if value.dtype == torch.float32 else value.to(torch.float32)
        lean.reduced.extend((param, value[start : start + numel].view(param.shape)) for param, start, numel in places)
        return buffer

    return future.then(keep)
