"""The step inside backward as each loop drives it: the backward performs the updates, the step keeps the books.

With ``optimizer_in_backward=True`` (:mod:`lightning_mp.master.in_backward`) the plugin's ``pre_backward`` arms the
hooks (:meth:`lightning_mp.stepping.OptimizerStep.begin_backward`), and whatever the loop calls its optimizer step
does only the bookkeeping of a step (the same class's): under the Trainer's automatic optimization the plugin's ``optimizer_step`` after the closure;
under manual optimization ``opt.step()`` after ``self.manual_backward(loss)``; under Lightning Fabric
``optimizer.step()`` after ``fabric.backward(loss)``.

Manual optimization and Fabric leave two things to the user's loop that setup cannot see, so they are refused where
they show, before they change anything:

* several backwards per step (gradient accumulation: ``fabric.no_backward_sync``, two ``manual_backward`` before a
  step): each backward updates the parameters, so the second one is stopped in ``pre_backward``
  (:data:`SEVERAL_BACKWARDS`);
* clipping after backward (``self.clip_gradients``, ``fabric.clip_gradients``): the gradients are used and freed
  inside backward (:func:`refuse_clipping`). Clipping by value that is already applied inside backward (automatic
  optimization with ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="value")``) passes.

The step's non-finite flags stay on the device (:mod:`lightning_mp.master.in_backward.flags`) and are read on the host
by the normal step's rule (:mod:`lightning_mp.stepping`): only where the decision is needed there, that is with a
skip observer (``PrecisionMonitor(localise_overflows=True)``), a step-interval LR scheduler on the optimizer (held on
a skipped step), or flags on the CPU (``stepping.DECIDE_CPU_FLAGS_ON_HOST``). Otherwise the scaler counts the step
from one device flag, with no synchronisation, and the names of the skipped parameters are read only if asked for
(:attr:`~lightning_mp.master.in_backward.StepInBackward.skipped_params`); the warning that names them comes with a
read, so on an accelerator without observer or step scheduler a skipped update shows in the scaler's count only,
as a skipped normal step does.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_mp.master.in_backward.hooks import StepInBackward
from lightning_mp.master.in_backward.settings import OPTION

#: Raised at a second backward before the optimizer step.
SEVERAL_BACKWARDS = (
    f"MixedPrecisionPlugin({OPTION}) updates the parameters inside each backward, so it takes one backward per "
    "optimizer step, and a second backward ran before optimizer.step() (gradient accumulation: "
    "fabric.no_backward_sync, or two manual_backward/fabric.backward calls before a step). This second backward was "
    "stopped before it updated anything. Call optimizer.step() after every backward (use a larger batch instead of "
    "accumulating), or use optimizer_in_backward=False to accumulate gradients."
)


def skipped_updates_message(names: list[str]) -> str:
    """The warning of a step whose parameters ``names`` had non-finite gradients (their updates were skipped)."""
    return (
        f"optimizer_in_backward: non-finite gradients in {len(names)} parameter(s) ({', '.join(names[:5])}"
        f"{', ...' if len(names) > 5 else ''}): their updates were skipped, the other parameters were updated."
    )


def refuse_clipping(in_backward: StepInBackward, clip_val: Optional[float], algorithm: Any, call: str) -> None:
    """Raise for clipping asked after backward (``call``: how the user asked), unless nothing is clipped or it is
    the clipping by value already applied inside backward (automatic optimization's ``gradient_clip_val``)."""
    if not clip_val:
        return
    algorithm = str(getattr(algorithm, "value", algorithm) or "norm")
    if algorithm == "value" and in_backward.grad_ops == [("clamp", float(clip_val))]:
        return  # Trainer(gradient_clip_val=..., gradient_clip_algorithm="value"): applied per parameter already
    if algorithm == "norm":
        why = "the norm needs every gradient at once, and each was used and freed inside backward"
    else:
        why = (
            "each gradient was used and freed inside backward; clipping by value runs inside backward only under "
            "automatic optimization with Trainer(gradient_clip_val=..., gradient_clip_algorithm='value')"
        )
    raise RuntimeError(
        f"MixedPrecisionPlugin({OPTION}) cannot clip by {algorithm} after backward ({call}): {why}. Remove the "
        "clipping, or use optimizer_in_backward=False to clip in manual optimization or under Fabric."
    )
