"""The step inside backward under FSDP2: each shard is updated right after its reduce-scatter, skips agreed.

FSDP2 (``fully_shard``, Lightning's ``ModelParallelStrategy``) keeps the sharded parameters (``DTensor`` s) in
``module.parameters()``; autograd sees only the unsharded ones it all-gathers for compute. In its post-backward
FSDP2 reduce-scatters a whole module group's gradients, sets each sharded parameter's ``grad`` to its reduced local
shard, and then runs that sharded parameter's own post-accumulate-grad hooks (torch 2.13,
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_reduce``). So the hooks
:class:`~lightning_mp.master.in_backward.StepInBackward` registers on the optimizer's parameters fire there, with the
final (reduced, bf16) gradient shard: each runs the one-pass lean update of the local shard
(:class:`~lightning_mp.distributed.fsdp2_lean.ShardedRemainderMasters`: bf16 shard + remainder; torchao's 8-bit Adam
by :mod:`~lightning_mp.distributed.fsdp2_eightbit`, its gradient checked and agreed before its kernel call) and frees
the gradient, the same per-tensor update the normal lean FSDP2 step runs after backward, hence the same bits.

Skips must agree on every rank, and neither flag is the same everywhere: the loss flag is rank-local (a NaN loss on
one rank only), and each gradient check reads this rank's shard only. Both are summed over the ranks
(:func:`~lightning_mp.distributed.sync.agree_found_inf`) before any update reads them: the loss flag once, before
backward (every rank enters backward), and each shard's flag in its hook, one all-reduce of one value per
parameter. That is one collective latency per parameter inside backward: the price of deciding each update as soon as
its shard exists (a flag per group would have to wait for the group's last shard, and FSDP2 runs the hooks one
parameter at a time). It is safe: FSDP2 runs the hooks in the same order on every rank, in the thread that runs
backward, between its own collectives. A non-finite loss on any rank skips every update on every rank (as the normal
step, whose agreed flag then is non-finite, skips the step); a non-finite gradient shard on any rank skips that
parameter's update on every rank, and the others are updated (the normal step skips all: the parameters then differ).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch

from lightning_mp.distributed.fsdp2_eightbit import ShardedAdam8bitStep
from lightning_mp.distributed.sync import agree_found_inf
from lightning_mp.master.in_backward import refusal
from lightning_mp.master.lean import optimizers


def register(in_backward: Any, device: torch.device, group: Optional[Any] = None) -> None:
    """Agree ``in_backward``'s skips over ``group`` (called from the FSDP2 side's connect, before any step).

    Raises:
        ValueError: an optimizer on the generic path (outside the table of :mod:`lightning_mp.master.lean.optimizers`
            and not torchao's 8-bit Adam in one pass): its proxies of whole local shards are not wired here.
    """
    generic = in_backward.update.generic
    if generic is not None and not isinstance(generic, ShardedAdam8bitStep):  # the generic path's proxies
        optimizer = in_backward.optimizer
        raise refusal(
            f"under FSDP2 steps {optimizers.names()} and torchao.optim.AdamW8bit, Adam8bit (in one pass) only, not "
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} (other optimizers step on proxies of whole "
            "local shards, not wired inside backward)",
            "Use one of those, strategy='ddp' for this optimizer, or optimizer_in_backward=False.",
        )
    # summed over the ranks; StepInBackward makes each agreed flag 0 or 1
    in_backward.agree_each = partial(agree_found_inf, device=device, group=group)
