"""The step inside backward as each loop drives it: the backward performs the updates, the step keeps the books.

With ``optimizer_in_backward=True`` (:mod:`lightning_mp.master.in_backward`) the plugin's ``pre_backward`` arms the
hooks (:func:`begin`), and whatever the loop calls its optimizer step does only the bookkeeping of a step
(:func:`finish_step`): under the Trainer's automatic optimization the plugin's ``optimizer_step`` after the closure;
under manual optimization ``opt.step()`` after ``self.manual_backward(loss)``; under Lightning Fabric
``optimizer.step()`` after ``fabric.backward(loss)``.

Manual optimization and Fabric leave two things to the user's loop that setup cannot see, so they are refused where
they show, before they change anything:

* several backwards per step (gradient accumulation: ``fabric.no_backward_sync``, two ``manual_backward`` before a
  step): each backward updates the parameters, so the second one is stopped in ``pre_backward`` (:func:`begin`);
* clipping after backward (``self.clip_gradients``, ``fabric.clip_gradients``): the gradients are used and freed
  inside backward (:func:`refuse_clipping`). Clipping by value that is already applied inside backward (automatic
  optimization with ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="value")``) passes.

The step's non-finite flags stay on the device (:mod:`lightning_mp.master.in_backward_flags`) and are read on the host
by the normal step's rule (:mod:`lightning_mp.stepping`): only where the decision is needed there, that is with a
skip observer (``PrecisionMonitor(localise_overflows=True)``), a step-interval LR scheduler on the optimizer (held on
a skipped step), or flags on the CPU (no device to wait for: reading is a memory read, cheaper than the device
path's ops; :data:`DECIDE_CPU_FLAGS_ON_HOST`). Otherwise the scaler counts the step from one device flag, with no
synchronisation, and the names of the skipped parameters are read only if asked for
(:attr:`~lightning_mp.master.in_backward.StepInBackward.skipped_params`); the warning that names them comes with a
read, so on an accelerator without observer or step scheduler a skipped update shows in the scaler's count only,
as a skipped normal step does.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_mp.master.in_backward import OPTION, check_setup, install
from lightning_mp.schedulers import has_step_scheduler, record_step

#: Read CPU flags on the host (as :data:`lightning_mp.stepping.DECIDE_CPU_FLAGS_ON_HOST` for the normal step; the
#: tests and ``benchmarks/host_work.py`` turn both off to run the accelerators' path on CPU tensors).
DECIDE_CPU_FLAGS_ON_HOST = True

#: Raised by :func:`begin` at a second backward before the optimizer step.
SEVERAL_BACKWARDS = (
    f"MixedPrecisionPlugin({OPTION}) updates the parameters inside each backward, so it takes one backward per "
    "optimizer step, and a second backward ran before optimizer.step() (gradient accumulation: "
    "fabric.no_backward_sync, or two manual_backward/fabric.backward calls before a step). This second backward was "
    "stopped before it updated anything. Call optimizer.step() after every backward (use a larger batch instead of "
    "accumulating), or use optimizer_in_backward=False to accumulate gradients."
)


def begin(plugin: Any, tensor: Tensor) -> None:
    """In ``pre_backward``, before a backward that performs the updates: refuse a second backward before the step
    (:data:`SEVERAL_BACKWARDS`), make writes into the model so far reach the masters, then arm the hooks with the
    loss's device check (a non-finite loss skips every update)."""
    in_backward = plugin._in_backward
    if in_backward.armed:  # armed since the last backward, and no step has finished it
        raise RuntimeError(SEVERAL_BACKWARDS)
    plugin.follow_model_writes()
    in_backward.begin(tensor)


def finish_step(plugin: Any, optimizer: Any, model: Any = None) -> bool:
    """The optimizer step after a backward that performed the updates: LR schedulers held on a skipped step, the
    scaler's count of skipped steps, and, where the flags are read (the module doc's rule: one host read), the report
    of non-finite values. ``False`` (and nothing done) when no backward ran since the last step (a ``training_step``
    that returned ``None``, a step without backward). With ``model`` (the Trainer's module, or Fabric's), a step with
    a skipped update also goes to ``skip_observers`` (PrecisionMonitor records and replays it; the replay's
    ``autograd.grad`` updates nothing)."""
    in_backward = plugin._in_backward
    if not in_backward.armed:
        return False
    flags = in_backward.finish()
    torch_optimizer = getattr(optimizer, "_optimizer", optimizer)
    if flags is None:  # no check: nothing skipped
        record_step(torch_optimizer, False)
        return True
    observers = plugin.skip_observers if model is not None else []
    if not (observers or has_step_scheduler(torch_optimizer) or (DECIDE_CPU_FLAGS_ON_HOST and flags.on_cpu)):
        record_step(torch_optimizer, flags.loss())  # a non-finite loss skipped every update; read if ever needed
        plugin.scaler.update(flags.found())  # on the device; max_consecutive_skips counts both kinds of skip
        return True
    skipped, names = flags.read()  # the step's one host read
    record_step(torch_optimizer, skipped)
    if names:
        rank_zero_warn(
            f"optimizer_in_backward: non-finite gradients in {len(names)} parameter(s) ({', '.join(names[:5])}"
            f"{', ...' if len(names) > 5 else ''}): their updates were skipped, the other parameters were updated."
        )
    for observer in observers if skipped or names else ():
        observer(plugin=plugin, optimizer=torch_optimizer, model=model)
    plugin.scaler.update(skipped or bool(names))  # max_consecutive_skips counts both
    return True


def refuse_clipping(plugin: Any, clip_val: Optional[float], algorithm: Any, call: str) -> None:
    """Raise for clipping asked after backward (``call``: how the user asked), unless nothing is clipped or it is
    the clipping by value already applied inside backward (automatic optimization's ``gradient_clip_val``)."""
    in_backward = plugin._in_backward
    if in_backward is None or not clip_val:
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


def add_optimizer(plugin: Any, module: Any, optimizers: list[Any]) -> None:
    """An optimizer set up after the module connected (Fabric's ``setup_module``, a forward, then
    ``setup_optimizers``): the hooks move to ``optimizers`` (refused as at setup if there are several); under DDP
    its communication hook, registered at connect, drives the new ones."""
    check_setup(None, module, optimizers)
    plugin._in_backward = install(
        plugin._in_backward, True, plugin.masters, module, optimizers, plugin._checking, plugin._param_names
    )
    if plugin._in_backward is not None:
        plugin._sync.hand_over(plugin._in_backward)
