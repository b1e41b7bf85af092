"""LR schedulers that do not advance on a skipped optimizer step.

Lightning steps ``interval="step"`` schedulers after every optimizer step, skipped or not (Lightning issues
16228, 18828, 21339); DeepSpeed, Megatron and fairseq hold the schedule back instead, and so do we. The plugin
calls :func:`record_step` after each optimizer step and :func:`guard_scheduler` on each step-interval
scheduler; a guarded scheduler's ``step()`` does nothing right after a skipped step of its optimizer (with
``frequency > 1``, the scheduler step that follows a skipped optimizer step is the one skipped).

Whether a step was skipped may be recorded as the step's found-inf flag, a device tensor: the guard reads it when
the scheduler steps (one host synchronisation), and only then. The plugin reads the flag itself, at the step,
for an optimizer that :func:`has_step_scheduler` (together with the loss scaler's state, in one transfer), so a
run with a step-interval scheduler pays one read per optimizer step and a run without one pays none.
"""

from __future__ import annotations

import weakref
from functools import cache
from typing import Any, Union

from torch import Tensor
from torch.optim import Optimizer

# optimizer -> whether its latest step was skipped (a bool, or a found-inf flag not read yet: > 0 when skipped)
_LAST_STEP_SKIPPED: weakref.WeakKeyDictionary[Optimizer, Union[bool, Tensor]] = weakref.WeakKeyDictionary()
# optimizers with a guarded scheduler
_GUARDED: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def record_step(optimizer: Optimizer, skipped: Union[bool, Tensor]) -> None:
    """Remember whether ``optimizer``'s latest step was skipped: a bool, or its found-inf flag (a tensor, read by
    the guard only if a guarded scheduler steps)."""
    _LAST_STEP_SKIPPED[optimizer] = skipped


def has_step_scheduler(optimizer: Any) -> bool:
    """Whether a scheduler guarded by :func:`guard_scheduler` steps ``optimizer``."""
    try:
        return optimizer in _GUARDED
    except TypeError:  # not weak-referenceable: never guarded
        return False


class _SkipAwareScheduler:
    """Placed before a scheduler's own class: ``step()`` does nothing right after a skipped optimizer step, and
    advances only on every ``frequency``-th optimizer step that ran.

    Lightning steps ``interval="step"`` schedulers after every optimizer step, skipped or not; DeepSpeed,
    Megatron and fairseq hold the schedule back instead, and so do we. With ``frequency > 1`` the count of steps
    that ran lives in the scheduler's ``__dict__``, so it is part of its ``state_dict`` and survives a resume
    (with frequency 1 the ``state_dict`` is unchanged); ``isinstance`` checks are unchanged.
    """

    optimizer: Optimizer

    def step(self, *args: Any, **kwargs: Any) -> Any:
        skipped = _LAST_STEP_SKIPPED.get(self.optimizer, False)
        if isinstance(skipped, Tensor):  # the flag, not read at the step: read it now (one host synchronisation)
            skipped = bool(skipped.reshape(-1)[0] > 0)
            _LAST_STEP_SKIPPED[self.optimizer] = skipped
        if skipped:
            return None
        frequency = self.__dict__.get("_steps_per_advance", 1)
        if frequency > 1:  # count the steps that ran; with frequency 1 there is nothing to count
            ran = self.__dict__.get("_optimizer_steps_ran", 0) + 1
            self.__dict__["_optimizer_steps_ran"] = ran
            if ran % frequency:
                return None
        # a mixin: super() is the scheduler's own class, after this one in the MRO (_skip_aware_class)
        return super().step(*args, **kwargs)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> Any:
        # pickle and deepcopy as the scheduler's own class, which can be imported
        return _rebuild_scheduler, (type(self).__mro__[2], self.__dict__.copy())


def _rebuild_scheduler(cls: type[object], state: dict[str, Any]) -> Any:
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler


@cache
def _skip_aware_class(cls: type) -> type:
    return type(cls.__name__, (_SkipAwareScheduler, cls), {"__module__": __name__, "__doc__": cls.__doc__})


def guard_step_schedulers(configs: list[Any]) -> None:
    """Guard every ``interval="step"`` scheduler of Lightning's scheduler configs (``connect``'s ``lr_schedulers``).
    The guard counts the optimizer steps that ran and applies the frequency itself, so Lightning (which counts
    batches) must call it after every optimizer step: its ``frequency`` becomes 1."""
    for config in configs:
        if getattr(config, "interval", "step") == "step":
            guard_scheduler(config.scheduler, frequency=getattr(config, "frequency", 1))
            if hasattr(config, "frequency"):
                config.frequency = 1


def guard_scheduler(scheduler: Any, frequency: int = 1) -> None:
    """Make ``scheduler.step()`` a no-op right after a skipped step of its optimizer, and advance it once every
    ``frequency`` optimizer steps that ran, counting each call of ``step()`` as one such step (in place,
    idempotent: guarding again keeps an earlier ``frequency > 1``)."""
    if not hasattr(scheduler, "optimizer"):
        return
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ValueError(f"frequency={frequency!r} is not allowed: it must be an integer >= 1.")
    if not isinstance(scheduler, _SkipAwareScheduler):
        kind: type = type(scheduler)
        scheduler.__class__ = _skip_aware_class(kind)
    _GUARDED.add(scheduler.optimizer)
    if frequency > 1:
        scheduler.__dict__["_steps_per_advance"] = frequency
