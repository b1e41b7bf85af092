"""The step inside backward under DDP: each bucket's parameters are updated once the bucket's all-reduce completed.

Under DDP a parameter's gradient is final only after the all-reduce of its bucket, which runs asynchronously during
backward; autograd's post-accumulate-grad hook fires before it, on the local gradient. So, as torch's own
``_hook_then_optimizer`` does, the per-parameter hooks of :class:`~lightning_mp.master.in_backward.StepInBackward`
are handed over to DDP's communication hook: the reduction is the plugin's usual one
(:func:`~lightning_mp.distributed.ddp._reduce_hook`: mean over the ranks, in ``reduce_dtype``, back into the bf16 or
fp32 bucket), and a ``fut.then(...)`` on it updates each of the bucket's parameters with its reduced gradient (a view
of the bucket) and frees the parameter's own gradient. The normal lean DDP step reads the same bucket values after
backward, hence the same bits. DDP is told that the optimizer runs in backward (``reducer._set_optimizer_in_backward``,
as torch's ``_apply_optim_in_backward_hook`` does), so that it does not write the gradients back after backward.

Gradients live until their bucket's all-reduce completed: beyond DDP's own bucket buffers (allocated once, 2 bytes
per bf16 parameter), at most the local gradients of the buckets in flight, bounded by ``bucket_cap_mb``.

Skips agree on every rank. Each gradient's inf/NaN check reads the reduced gradient, the same bits on every rank.
The loss flag is rank-local (a NaN loss on one rank only), so it is summed over the ranks once per backward, in the
hook of the first bucket, before any reduction of the backward is started and any update reads it: every rank then
skips every update of that step, as the normal step (whose reduced gradients are all non-finite then) skips it.
"""

# no `from __future__ import annotations`: DDP checks the hook's annotations against the real classes
import threading
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_mp.distributed.sync import agree_found_inf


class BucketUpdates:
    """The communication hook's state: the reduction's own state, the updates to run, and where the flag lives.

    Args:
        reduce_hook: the plugin's reduction of a bucket (:func:`~lightning_mp.distributed.ddp._reduce_hook`).
        reduce_state: what ``reduce_hook`` needs (group, ``reduce_dtype``).
        in_backward: the plugin's :class:`~lightning_mp.master.in_backward.StepInBackward`.
        device: where the loss flag is summed (the strategy's root device).
    """

    def __init__(
        self, reduce_hook: Any, reduce_state: Any, in_backward: Any, device: torch.device, ddp: Any = None
    ) -> None:
        self.reduce_hook = reduce_hook
        self.reduce_state = reduce_state
        self.in_backward = in_backward
        self.device = device
        self.ddp = ddp  # the DDP module whose hook this is (hand_over)
        # gloo completes a reduction on one of its worker threads, where fut.then() runs: two buckets' updates
        # could run at once, and the one-pass update's staging buffers are shared
        self.lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "in_backward": None, "lock": None, "ddp": None}  # a run's objects: not pickled

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()


def register(
    ddp: DistributedDataParallel, reduce_hook: Any, reduce_state: Any, in_backward: Any, device: torch.device
) -> BucketUpdates:
    """Drive ``in_backward``'s updates of DDP's parameters from DDP's communication hook (called at connect, before
    any step; ``in_backward`` ``None`` when no optimizer is set up yet: Fabric's ``setup_module``, then a forward,
    then :func:`hand_over` at ``setup_optimizers``). Raises ``ValueError`` for a DDP setup whose buckets cannot say
    when every gradient is final."""
    if ddp.find_unused_parameters:
        raise ValueError(
            "MixedPrecisionPlugin(optimizer_in_backward=True) cannot run under DDP with find_unused_parameters=True: "
            "a parameter unused on every rank has no gradient and must not be updated, but its bucket cannot tell "
            "it apart. Use strategy='ddp' (find_unused_parameters=False), or optimizer_in_backward=False."
        )
    if not hasattr(getattr(ddp, "reducer", None), "_set_optimizer_in_backward"):
        raise ValueError(
            f"MixedPrecisionPlugin(optimizer_in_backward=True) needs DDP's optimizer-in-backward mode, which torch "
            f"{torch.__version__} lacks (reducer._set_optimizer_in_backward). Use optimizer_in_backward=False."
        )
    state = BucketUpdates(reduce_hook, reduce_state, None, device, ddp)
    ddp.register_comm_hook(state, _reduce_then_update)  # DDP takes one hook, once: it stays, the updates move
    if in_backward is not None:
        hand_over(state, in_backward)
    return state


def hand_over(state: BucketUpdates, in_backward: Any) -> None:
    """Make ``in_backward`` the one whose updates DDP's communication hook drives (at connect, or for an optimizer
    set up after the module connected: Fabric's ``setup_module``, a forward, then ``setup_optimizers``)."""
    ddp = state.ddp
    managed = getattr(ddp, "_module_parameters", None) or [p for p in ddp.module.parameters() if p.requires_grad]
    held = {id(p) for group in in_backward.optimizer.param_groups for p in group["params"]}
    left_out = [p for p in managed if p.requires_grad and id(p) not in held]
    if left_out:  # a gradient nobody frees would make DDP write its bucket back over the updated ones' (measured)
        names = ", ".join(in_backward.names.get(id(p), f"parameter {tuple(p.shape)}") for p in left_out[:5])
        raise ValueError(
            f"MixedPrecisionPlugin(optimizer_in_backward=True) under DDP needs every parameter DDP reduces in the "
            f"optimizer, but {len(left_out)} that require grad are not ({names}{', ...' if len(left_out) > 5 else ''})"
            ": their gradients would outlive the step inside DDP's buckets. Freeze them (requires_grad_(False) "
            "before the strategy wraps the model, e.g. in __init__ or configure_model), add them to the optimizer, "
            "or use optimizer_in_backward=False."
        )
    in_backward.hand_over(managed)  # the others (parameters DDP ignores) keep their per-parameter hooks
    state.in_backward = in_backward
    ddp.reducer._set_optimizer_in_backward()  # DDP leaves the gradients to us after backward


def _reduce_then_update(
    state: BucketUpdates, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The plugin's reduction of ``bucket``, then the update of each of its parameters with its reduced gradient."""
    in_backward = state.in_backward
    if bucket.index() == 0 and in_backward is not None and in_backward.armed:
        # DDP starts buckets in index order on every rank: this all-reduce is the backward's first collective
        in_backward.agree_on_loss(lambda flag: agree_found_inf(flag, state.device, state.reduce_state.group))
    future = state.reduce_hook(state.reduce_state, bucket)

    def update(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        buffer = fut.value()
        if in_backward is not None:
            with state.lock:
                for param, grad in zip(bucket.parameters(), bucket.gradients()):
                    in_backward.update_with(param, grad)
        return buffer

    return future.then(update)
