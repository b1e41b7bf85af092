"""The optimizers the step updates: the masters are attached to them and the step inside backward runs on them, from
connect to teardown, and they follow the ones the Trainer's strategy holds now.

An optimizer can be swapped mid-fit: the module changes what ``configure_optimizers`` returns and a callback calls
``trainer.strategy.setup_optimizers(trainer)``, or code sets ``trainer.strategy.optimizers = [new]``. Lightning then
steps the new one; the plugin's masters and hooks were set up on the old one at connect. :class:`HeldOptimizers`
compares, before every backward and every step, the strategy's optimizers with those it holds (by identity: one
comparison per optimizer, nothing per parameter) and, when they differ, moves everything to the new ones, as connect
set it up on the old: fp32 masters in the new optimizer's groups (:meth:`~lightning_mp.master.MasterWeights.
follow_optimizers`: the old one gets the model's parameters back, masters no parameter is trained by any more are
released), lean masters' preparation of the new optimizer (its load hooks, the generic path's slices; the old one's
released), the step inside backward on the new one (the old hooks removed; the refusals of setup apply: several
optimizers, accumulation, clipping by norm), under DDP or FSDP2 handed to the strategy's reduction. The new optimizer
is then stepped exactly as the normal step steps it, and its state is what a checkpoint saves.

Under Fabric the optimizers are the ones set up (``fabric.setup_optimizers``): :meth:`HeldOptimizers.add`.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from lightning_mp.master.in_backward import check_setup, install
from lightning_mp.master.toggle import follow_toggles, unfollow_toggles
from lightning_mp.schedulers import guard_step_schedulers


class HeldOptimizers:
    """What connect set the step up on, and the following of the Trainer's strategy (module docstring).

    Args:
        steps: the :class:`~lightning_mp.stepping.OptimizerStep` whose ``masters``, ``in_backward``, ``sync``,
            ``names``, ``checking`` and ``unscaled`` this sets up.
    """

    def __init__(self, steps: Any) -> None:
        self.steps = steps
        self.trainer: Optional[Any] = None  # None: Fabric, or the hooks called by hand
        self.module: Optional[Any] = None  # the module the step updates (inside any DDP wrapper)
        self.in_backward = False  # whether the updates run inside backward
        self.optimizers: tuple[Any, ...] = ()

    def hold(self, trainer: Any, module: Any, optimizers: list[Any], in_backward: bool) -> None:
        """At connect: the masters attach to ``optimizers`` (torch optimizers) and the step inside backward
        (``in_backward``) runs on them, after the refusals of setup (:func:`~lightning_mp.master.in_backward.
        check_setup`; callbacks the masters cannot run with); the ``trainer``'s strategy is followed (:meth:`follow`)."""
        self.trainer, self.module, self.in_backward = trainer, module, in_backward
        steps, weights = self.steps, self.steps.weights
        if in_backward:
            check_setup(trainer, module, optimizers)
        weights.check_callbacks(getattr(trainer, "callbacks", None) or [])
        weights.attach(optimizers)
        self._name_masters()
        if weights.groups_hold_masters:  # toggle_optimizer must switch the model's parameters, not the masters
            follow_toggles(module, weights)
        steps.in_backward = install(
            steps.in_backward, in_backward, steps.masters, module, optimizers, steps.checking, steps.names
        )
        self.optimizers = tuple(optimizers)

    def follow(self) -> Optional[list[Any]]:
        """Move the masters and the step inside backward to the optimizers the strategy holds now, where they are
        others; the new optimizers (torch's), or ``None`` when nothing changed. Not between a backward that ran the
        updates and its step (that step is the old optimizer's): at the next backward."""
        trainer, held, steps = self.trainer, self.optimizers, self.steps
        if trainer is None:
            return None
        current = trainer.strategy.optimizers
        if len(current) == len(held) and all(map(operator.is_, current, held)):  # the optimizers, by identity
            return None
        if steps.in_backward is not None and steps.in_backward.armed:
            return None
        optimizers = [getattr(optimizer, "_optimizer", optimizer) for optimizer in current]
        module = self.module
        if self.in_backward:  # several optimizers, accumulation, clipping by norm: refused before any update
            check_setup(trainer, module, optimizers)
        steps.weights.follow_optimizers(optimizers)
        self._name_masters()
        if self.in_backward:
            steps.in_backward = install(
                steps.in_backward, True, steps.masters, module, optimizers, steps.checking, steps.names
            )
            if steps.in_backward is not None:
                steps.sync.hand_over(steps.in_backward)  # DDP, FSDP2: the strategy's reduction drives the new updates
        guard_step_schedulers(trainer.strategy.lr_scheduler_configs)  # the new schedulers hold on a skipped step
        steps.unscaled.clear()
        self.optimizers = tuple(optimizers)
        return optimizers

    def add(self, module: Any, optimizers: list[Any]) -> None:
        """An optimizer set up after the module connected (Fabric's ``setup_module``, a forward, then
        ``setup_optimizers``): the step inside backward moves to ``optimizers`` (refused as at setup if there are
        several); under DDP its communication hook, registered at connect, drives the new ones."""
        steps = self.steps
        check_setup(None, module, optimizers)
        steps.in_backward = install(
            steps.in_backward, True, steps.masters, module, optimizers, steps.checking, steps.names
        )
        if steps.in_backward is not None:
            steps.sync.hand_over(steps.in_backward)

    def release(self) -> None:
        """At teardown: the hooks of the step inside backward removed, nothing followed any more."""
        self.steps.in_backward = install(self.steps.in_backward, False)
        unfollow_toggles(self.module)
        self.trainer, self.module, self.optimizers = None, None, ()

    def _name_masters(self) -> None:
        names = self.steps.names
        for param, master in self.steps.weights.pairs():
            names[id(master)] = names.get(id(param), "")
