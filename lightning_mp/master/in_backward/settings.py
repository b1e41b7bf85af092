"""The refusal every setup of the step inside backward raises, and the Trainer's settings it reads before each backward.

``accumulate_grad_batches``, ``gradient_clip_val`` and ``gradient_clip_algorithm`` are read at setup
(:func:`~lightning_mp.master.in_backward.check_setup`) and again before every backward (:func:`trainer_grad_ops`, a
few attribute reads), where a callback may have changed them since (Lightning's ``GradientAccumulationScheduler`` in
``on_train_epoch_start``, a user's callback setting ``trainer.gradient_clip_val``): clipping by value is followed
(applied per parameter inside the update from that backward on, as the normal step clips from that step on);
accumulation and clipping by norm are refused there, before that backward updates anything, naming the setting and,
for the scheduler, the callback and the epoch.
"""

from __future__ import annotations

from typing import Any, Optional

OPTION = "optimizer_in_backward=True"


def refusal(reason: str, change: str) -> ValueError:
    """The one error each setup that cannot step in backward raises: the option, why, and what to change."""
    return ValueError(f"MixedPrecisionPlugin({OPTION}) {reason}. {change}")


def accumulation_schedule(callback: Any) -> Optional[dict[int, int]]:
    """The ``scheduling`` of a Lightning ``GradientAccumulationScheduler`` that accumulates at some epoch, else
    ``None``."""
    schedule = getattr(callback, "scheduling", None)
    if type(callback).__name__ != "GradientAccumulationScheduler" or not isinstance(schedule, dict):
        return None
    return schedule if any(factor != 1 for factor in schedule.values()) else None


def trainer_grad_ops(trainer: Any, when: str) -> list[tuple[str, Any]]:
    """The clipping the Trainer's settings ask of each update now (``[("clamp", value)]`` for clipping by value, else
    ``[]``); a :func:`refusal` for accumulation and clipping by norm, which cannot run inside backward. Read at
    setup and again before every backward (``when`` says which: a callback may change them during fit, e.g.
    Lightning's ``GradientAccumulationScheduler``), so that a refusal comes before any update it concerns."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        schedules = [cb for cb in getattr(trainer, "callbacks", None) or [] if accumulation_schedule(cb)]
        by = (
            f"by {type(schedules[0]).__name__}(scheduling={schedules[0].scheduling}) at epoch "
            f"{getattr(trainer, 'current_epoch', '?')}"
            if schedules
            else "by a callback or the LightningModule during fit"
        )
        raise refusal(
            f"cannot accumulate gradients: Trainer.accumulate_grad_batches is {accumulate} {when}, set {by}; each "
            "gradient is used and freed in the backward that produced it. This backward was stopped before it "
            "updated anything",
            "Keep accumulate_grad_batches at 1 (remove the scheduler or the callback that raises it, use a larger "
            "batch), or use optimizer_in_backward=False.",
        )
    clip_val = getattr(trainer, "gradient_clip_val", None)
    if not clip_val:
        return []
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    algorithm = str(getattr(algorithm, "value", algorithm) or "norm")
    if algorithm == "norm":
        during = "" if when == "at setup" else ", set during fit (by a callback or the LightningModule)"
        raise refusal(
            f"cannot clip by the global norm (gradient_clip_val={clip_val}, gradient_clip_algorithm='norm' {when}"
            f"{during}): the norm needs every gradient, and each is used and freed as soon as it is final"
            + ("" if when == "at setup" else ". This backward was stopped before it updated anything"),
            "Clip by value (gradient_clip_algorithm='value': applied per parameter inside backward), or use "
            "optimizer_in_backward=False.",
        )
    return [("clamp", float(clip_val))]
