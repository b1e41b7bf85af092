"""An optimizer replaced during fit: set up again before the backward and the step that use it.

Lightning's ``trainer.strategy.setup_optimizers(trainer)`` (or assigning ``trainer.strategy.optimizers``) replaces
the optimizers without a new ``connect``. With fp32 masters the new optimizer would hold the model's half parameters,
whose gradients move to the masters (it would step nothing); the hooks of the step inside backward would keep
stepping the old optimizer. The plugin compares the strategy's optimizers with those it set up (identity, before each
backward and each step) and calls :func:`follow_replaced` when they differ.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_mp.master.in_backward import check_setup, install, refusal


def follow_replaced(steps: Any, trainer: Any, module: Any, optimizers: list[Optimizer], in_backward: bool) -> list:
    """Attach the masters of ``steps`` (:class:`lightning_mp.stepping.OptimizerStep`) to ``optimizers`` and move the
    step inside backward (``in_backward``) to them, as ``connect`` does; ``optimizers``, now the ones set up.

    Raises:
        ValueError: the step inside backward under DDP or FSDP2 (their reduction drives the updates of the optimizer
            set up with them), or a new optimizer it cannot step (as at setup); before any update.
    """
    inner = getattr(module, "module", module)
    current = steps.in_backward
    if current is not None and current.driven_by_strategy:
        raise refusal(
            "cannot follow an optimizer replaced during fit (trainer.strategy.setup_optimizers or "
            "trainer.strategy.optimizers = ...) under DDP or FSDP2: the strategy's reduction drives the updates of "
            "the optimizer it was set up with. This backward was stopped before it updated anything",
            "Keep one optimizer for the whole fit (change its param groups, options or state instead), or use "
            "optimizer_in_backward=False.",
        )
    if in_backward:
        check_setup(trainer, inner, optimizers)
    masters = steps.masters
    if masters is not None and not steps.sync.owns_masters:
        masters.attach(optimizers)
        for param, master in masters.pairs():
            steps.names[id(master)] = steps.names.get(id(param), "")
    if current is not None:
        steps.in_backward = install(current, True, masters, inner, optimizers, steps.checking, steps.names)
    return optimizers
