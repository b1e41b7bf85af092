"""What changes during fit under the step inside backward: param groups and their options (followed), hooks added
later (refused).

**Param groups.** ``optimizer.add_param_group`` after setup (Lightning's ``BackboneFinetuning`` and
``BaseFinetuning.unfreeze_and_add_param_group``, a user's callback) brings parameters the hooks set up at connect do
not know, and edits of a group's list (``append``, ``del``, item assignment, a parameter moved to another group, a new
list) change which parameters are stepped and with which options.
:class:`~lightning_mp.master.in_backward.StepInBackward` checks the groups before every backward
(:func:`~lightning_mp.master.following.seen`, a few identity checks per group) and, when they changed, gives every
parameter of the current groups its one-parameter group (:func:`one_groups`, its group's options) and its hook; the
store made their lean state at the conversion (every floating parameter of the module is converted, frozen or not)
and checks they are the model's (:meth:`~lightning_mp.master.RemainderMasters.follow_groups`). The new parameters are then updated inside backward
exactly as the normal lean step, which reads the groups at each step, updates them. Add groups before the backward
(``on_train_epoch_start``, ``on_train_batch_start``): a parameter added after its gradient was made is not updated
and fails the "no update left behind" check at the step.

**Group options.** Each parameter's update reads a one-parameter group (a dict of its own, for its whole life: the
CUDA kernel caches its address tables by ``id(group)``). A scheduler changes ``lr`` between steps, a resume
(``optimizer.load_state_dict``) replaces the group dicts: :class:`GroupOptions` compares each group's options with
what it saw last, once per step before backward (a few identity checks per group), and copies only what changed into
that group's one-parameter dicts, so a hook reads its options without copying a dict.

**The Trainer's settings** (accumulation, clipping) changed by a callback are read before each backward:
:mod:`~lightning_mp.master.in_backward.settings`.

**Post-accumulate-grad hooks added later.** A user's ``register_post_accumulate_grad_hook`` registered before
the plugin's (before fit) runs first and sees (or rewrites) the gradient the update then uses, as the normal step
would. One registered after setup would run after the update, on a gradient that is gone: :func:`later_hooks`
raises before the backward that would run it, before any update of that backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

#: The refusal under DDP and FSDP2 (their reduction drives the updates of the parameters known at setup).
UNDER_REDUCTION = (
    "cannot follow param groups added after setup (optimizer.add_param_group) under DDP or FSDP2: the strategy's "
    "reduction drives the updates of the parameters it was set up with. This backward was stopped before it "
    "updated anything. Put every parameter in the optimizer in configure_optimizers (frozen ones are left alone "
    "until they are unfrozen, then updated), or use optimizer_in_backward=False."
)


def one_groups(
    optimizer: Optimizer, known: dict[int, tuple[int, dict[str, Any]]]
) -> tuple[dict[int, tuple[int, dict[str, Any]]], list[Tensor]]:
    """``(id(param) -> (its group's index, its one-parameter group), every parameter)`` of ``optimizer``'s current
    groups. A parameter in ``known`` keeps its one-parameter dict (the CUDA kernel caches its address tables by
    ``id(group)``); a new one gets a copy of its group's options (read again at each update)."""
    ones: dict[int, tuple[int, dict[str, Any]]] = {}
    params: list[Tensor] = []
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            before = known.get(id(param))
            ones[id(param)] = (index, before[1] if before is not None else {**group, "params": [param]})
            params.append(param)
    return ones, params


def later_hooks(params: list[Tensor], hooks: dict[int, Any], name: Callable[[Tensor], str], option: str) -> None:
    """Raise when the last post-accumulate-grad hook of one of ``params`` is not the plugin's (``hooks``: ``id(param)
    -> handle``): before backward, so that no update of the step runs first. One length check per parameter."""
    for param in [p for p in params if len(p._post_accumulate_grad_hooks or ()) > 1]:
        ours = hooks.get(id(param))
        if ours is not None and next(reversed(param._post_accumulate_grad_hooks)) != ours.id:
            raise RuntimeError(
                f"MixedPrecisionPlugin({option}): {name(param)} has a post-accumulate-grad hook registered after the "
                "plugin's, which would run after the update, when the gradient is used and gone (the normal step "
                "would let it read or rewrite the gradient first). This backward was stopped before it updated "
                "anything. Register it before fit (in __init__ or configure_model), use a tensor hook "
                "(p.register_hook), or optimizer_in_backward=False."
            )


class GroupOptions:
    """The one-parameter groups of :func:`one_groups` kept up to date with ``optimizer``'s groups, group by group.

    Made (and every one-parameter group brought up to date) at setup and whenever the groups change;
    :meth:`refresh` before each backward copies the options that changed since (compared by identity: a new value is
    a new object, and a tensor option is never read on the host here)."""

    def __init__(self, optimizer: Optimizer, ones: dict[int, tuple[int, dict[str, Any]]]) -> None:
        self.optimizer = optimizer
        self._members: list[list[dict[str, Any]]] = [[] for _ in optimizer.param_groups]
        for index, one in ones.values():
            self._members[index].append(one)
        self._seen: list[dict[str, Any]] = [{} for _ in optimizer.param_groups]
        self.refresh()

    def refresh(self) -> None:
        """Copy into the one-parameter groups each option whose value changed since the last call."""
        for group, seen, members in zip(self.optimizer.param_groups, self._seen, self._members):
            changed = {key: value for key, value in group.items() if seen.get(key, seen) is not value}
            changed.pop("params", None)
            if not changed:  # the usual step
                continue
            for one in members:
                one.update(changed)
            seen.update(changed)
