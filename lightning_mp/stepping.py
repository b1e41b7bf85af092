"""The order of one optimizer step, in one place; the scaler (:mod:`lightning_mp.scaler`) does the arithmetic.

``MixedPrecisionPlugin.optimizer_step`` hands its arguments to :func:`optimizer_step`, which runs, in this order:

1. the closure (forward, backward: ``pre_backward`` scaled the loss);
2. unscale the gradients once since their backward and check them for inf/NaN (:class:`UnscaledGradients`: early
   unscales, by clipping in manual optimization, are not repeated); the found-inf flag is a device tensor;
3. agree on the flag across ranks (the strategy's ``GradientSync.agree``: one all-reduce of the device tensor);
4. Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, on the unscaled gradients;
5. :func:`step`: step the optimizer or skip the step, then copy fp32 masters back into the model;
6. update the scale (``DynamicLossScaler.update``).

A step's found-inf flag is a device tensor, and :func:`step` reads it on the host (one synchronisation, together
with the scaler's pending state) only where the decision is needed there:

  * the optimizer cannot skip on the device (:func:`skips_on_device`: masters with ``fused_step(optimizer,
    found_inf)``, or torch's ``fused=True`` Adam, AdamW, SGD and Adagrad, which declare
    ``_step_supports_amp_scaling`` and take the flag as their ``found_inf`` attribute, the protocol of
    ``torch.amp.GradScaler``). An exact skip of, say, the for-loop AdamW would need a copy of the parameters and
    the optimizer state before each step and a ``torch.where`` after it, measured at +36% of AdamW's step time for
    a small MLP and +35% for a large one on CPU, and one more copy of the whole state: more than the one read saves;
  * a scheduler with ``interval="step"`` is guarded on this optimizer (it must not advance on a skipped step, and
    it is stepped on the host right after the optimizer);
  * a skip observer is registered (``PrecisionMonitor(localise_overflows=True)`` replays the skipped step while
    its batch, gradients and parameters are those of that step);
  * the flag lives on the CPU (CPU training): there is no device to wait for, reading it is a memory read, and
    the small tensor ops of the device path cost far more host time than the branch they replace (measured on a
    2-core AVX2 EPYC, torch 2.13 CPU: reading the flag and applying the rules on the host takes 1 us a step; the
    rules on the device 175 us for a check-only scaler, 740 us for a dynamic one, 20-60 us per tiny op; see
    benchmarks/HISTORY.md, 2026-11-25). :data:`DECIDE_CPU_FLAGS_ON_HOST` turns this off (the tests do, to run the
    accelerators' path on CPU tensors).

On an accelerator the device path launches about 9 small kernels a step for a check-only or static scaler and about
30 for a dynamic one (plus the 0/1 flag's two): host launch time, traded for the synchronisation it removes. What does
not change between steps (each optimizer's parameters grouped by device and dtype, their names) is built once.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.optim import LBFGS

from lightning_mp.master import in_backward_loop
from lightning_mp.scaler import DynamicLossScaler
from lightning_mp.scaler_device import GradientGroups
from lightning_mp.schedulers import has_step_scheduler, record_step

#: Decide on the host when the found-inf flag is a CPU tensor (no device to wait for; see the module docstring).
DECIDE_CPU_FLAGS_ON_HOST = True


def optimizer_step(
    plugin: Any,
    optimizer: Any,
    model: Any,
    closure: Callable[[], Any],
    kwargs: dict[str, Any],
    plain_step: Callable[[], Any],
) -> Any:
    """``plugin``'s optimizer step, in the order of the module docstring. ``plain_step`` is Lightning's own
    (closure, hooks and clipping inside ``optimizer.step``): the step without a check and without self-updating
    masters takes it."""
    masters, checking = plugin.masters, plugin._checking
    if isinstance(optimizer, LBFGS) and (checking or masters is not None):
        raise MisconfigurationException(
            "MixedPrecisionPlugin with an inf/NaN check or master weights cannot drive LBFGS: it re-evaluates "
            "the closure inside step(), where gradients cannot be checked and the half model is stale. Use "
            "MixedPrecisionPlugin('bf16-mixed', scaler={'enabled': False}) without master weights, or fp32."
        )
    if not checking:
        if callable(getattr(masters, "fused_step", None)):  # masters that update themselves
            closure()
            plugin._after_closure(model, optimizer)
            return masters.fused_step(unwrap_optimizer(optimizer), None)
        step_output = plain_step()
        if masters is not None:
            masters.masters_to_model(unwrap_optimizer(optimizer))
        return step_output
    closure_result = closure()
    if closure_result is None and model.automatic_optimization:
        # training_step returned None: no backward ran, so nothing to unscale or step. Hooks and clipping
        # still run, as in Lightning; whatever they unscale stays recorded until the next backward ends it
        plugin._after_closure(model, optimizer)
        return None
    # unscale after the closure and before on_before_optimizer_step, so hooks and clipping see true grads
    torch_optimizer = unwrap_optimizer(optimizer)
    unscaled = plugin._unscaled.unscale(plugin.scaler, torch_optimizer, plugin._param_names)  # once since backward
    found_inf = plugin._sync.agree(unscaled)  # every rank takes the same decision, on the device
    plugin._after_closure(model, optimizer)
    plugin._unscaled.consumed(torch_optimizer)
    return step(plugin, optimizer, model, found_inf, kwargs)  # skipped on the device where it can be


def step_in_backward(plugin: Any, optimizer: Any, model: Any, closure: Callable[[], Any]) -> Any:
    """The step with ``optimizer_in_backward=True``: the closure's backward updated each parameter as its gradient
    became final (:class:`~lightning_mp.master.in_backward.StepInBackward`, armed in ``pre_backward``), so no update
    is left; what is left is the bookkeeping of a step (:func:`lightning_mp.master.in_backward_loop.finish_step`) after
    Lightning's hooks (gradients are ``None`` by then). In manual optimization the closure does nothing: the user's
    ``manual_backward`` already ran."""
    closure_result = closure()
    plugin._after_closure(model, optimizer)
    in_backward_loop.finish_step(plugin, optimizer, model)  # nothing when no backward ran (training_step returned None)
    return closure_result


def step_after_backward(plugin: Any, optimizer: Any, model: Any, kwargs: dict[str, Any]) -> Any:
    """The step when the backward already ran (Lightning Fabric's ``optimizer.step()``: no closure), in the order of
    :func:`optimizer_step` after its closure: unscale once and check, agree across ranks, step or skip, update."""
    plugin.follow_model_writes()  # writes into the model since the last step reach the masters before the update
    masters = plugin.masters
    if not plugin._checking:
        if callable(getattr(masters, "fused_step", None)):  # masters that update themselves
            return masters.fused_step(optimizer, None)
        output = optimizer.step(**kwargs)
        if masters is not None:
            masters.masters_to_model(optimizer)
        return output
    found_inf = plugin._sync.agree(unscale_once(plugin, optimizer))  # every rank takes the same decision
    plugin._unscaled.consumed(optimizer)
    return step(plugin, optimizer, model, found_inf, kwargs)


def unscale_once(plugin: Any, optimizer: Any) -> Tensor:
    """Unscale ``optimizer``'s grads unless already done since their backward; the found-inf flag tensor."""
    return plugin._unscaled.unscale(plugin.scaler, unwrap_optimizer(optimizer), plugin._param_names)


# ------------------------------------------------------------------------------------------ clipping
def unscale_before_clipping(plugin: Any, optimizer: Any, clip_val: float) -> None:
    """In manual optimization ``self.clip_gradients`` runs inside training_step, before ``opt.step()``: unscale
    here so clipping sees true gradients; the step then does not unscale twice. Fused optimizers need no special
    case: their step() is always called on unscaled gradients."""
    if clip_val > 0 and plugin._checking and has_grads(optimizer):
        unscale_once(plugin, optimizer)


def clip_grad_by_value(plugin: Any, optimizer: Any, clip_val: float, plain: Callable[[Any, float], None]) -> None:
    """No gradients (a training_step that returned None): nothing to clip, and torch's value clipping fails there.
    Lean masters clip the fp32 gradients inside their step (bf16 gradients would round the clipped values)."""
    if has_grads(optimizer):
        lean = getattr(plugin.masters, "clip_grad_value_", None)
        lean(unwrap_optimizer(optimizer), clip_val) if lean else plain(optimizer, clip_val)


def clip_grad_by_norm(plugin: Any, optimizer: Any, clip_val: float, plain: Callable[[Any, float], None]) -> None:
    """Lean masters clip by the norm of their fp32 gradients; anything else as Lightning does (``plain``)."""
    lean = getattr(plugin.masters, "clip_grad_norm_", None)
    lean(unwrap_optimizer(optimizer), clip_val) if lean else plain(optimizer, clip_val)


# ------------------------------------------------------------------------------------------ step or skip
def skips_on_device(optimizer: Any, masters: Any = None) -> bool:
    """Whether a step of ``optimizer`` (a torch optimizer) can be skipped on the device by a found-inf flag: the
    masters' ``fused_step`` takes it, or the optimizer follows ``torch.amp.GradScaler``'s attribute protocol: it
    declares ``_step_supports_amp_scaling`` (torch's ``fused=True`` optimizers) and its ``step`` has no
    ``grad_scaler`` argument (the deprecated protocol, where the optimizer would expect a torch ``GradScaler``)."""
    if callable(getattr(masters, "fused_step", None)):
        return True
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    honours = _HONOURS_FOUND_INF.get(type(optimizer))
    if honours is None:
        try:
            honours = "grad_scaler" not in inspect.signature(optimizer.step).parameters
        except (TypeError, ValueError):  # no signature to read: decide on the host
            honours = False
        _HONOURS_FOUND_INF[type(optimizer)] = honours
    return honours


_HONOURS_FOUND_INF: dict[type, bool] = {}


def step(plugin: Any, optimizer: Any, model: Any, found_inf: Tensor, kwargs: dict[str, Any]) -> Any:
    """The plugin's optimizer step once the gradients are unscaled and checked: ``found_inf`` is the flag every rank
    agreed on. Skipped on the device where the optimizer can and nothing needs the decision on the host (see the
    module docstring); otherwise the flag is read here, once, with the scaler's state. Then the scaler updates."""
    scaler: DynamicLossScaler = plugin.scaler
    torch_optimizer = unwrap_optimizer(optimizer)
    observers = plugin.skip_observers
    on_host = observers or (DECIDE_CPU_FLAGS_ON_HOST and found_inf.is_cpu)
    if not on_host and skips_on_device(torch_optimizer, plugin.masters) and not has_step_scheduler(torch_optimizer):
        flag = found_inf.clamp(max=1.0)  # 0-dim, exactly 0 or 1 (a sum over ranks may be more), as fused kernels expect
        record_step(torch_optimizer, flag)
        output = _step(plugin.masters, optimizer, torch_optimizer, flag, kwargs)
        scaler.update(found_inf)
        return output
    skip = scaler.read_found_inf(found_inf)  # the step's one host synchronisation
    record_step(torch_optimizer, skip)
    output = None if skip else _step(plugin.masters, optimizer, torch_optimizer, None, kwargs)
    for observer in observers if skip else ():  # the diagnostics extension point (MixedPrecisionPlugin.__init__)
        observer(plugin=plugin, optimizer=torch_optimizer, model=model)
    scaler.update(skip)
    return output


def _step(masters: Any, optimizer: Any, torch_optimizer: Any, flag: Optional[Tensor], kwargs: dict[str, Any]) -> Any:
    """Step ``optimizer``, skipped on the device where ``flag`` (0/1) is 1; ``flag=None``: step."""
    fused_step = getattr(masters, "fused_step", None)
    if callable(fused_step):  # masters that update themselves (and the model's weights)
        return fused_step(torch_optimizer, flag)
    if flag is None:
        output = optimizer.step(**kwargs)
    else:  # torch.amp.GradScaler's protocol: gradients already unscaled (grad_scale None), skip where found_inf is 1
        torch_optimizer.grad_scale, torch_optimizer.found_inf = None, flag
        try:
            output = optimizer.step(**kwargs)
        finally:
            del torch_optimizer.grad_scale, torch_optimizer.found_inf
    if masters is not None:  # flat fp32 masters: a skipped step copies back the unchanged values
        masters.masters_to_model(torch_optimizer)
    return output


# ------------------------------------------------------------------------------------------ unscale once
class UnscaledGradients:
    """Per-optimizer record of gradients unscaled since their backward: every ``optimizer.step()`` the plugin lets
    through sees gradients unscaled exactly once since the backward that produced them, and checked for inf/NaN.

    Unscaling can happen early (``clip_gradients`` in manual optimization, or clipping on a step whose
    ``training_step`` returned ``None``) and the step that would consume it may never come (a batch that clips but
    does not step). So the record of "these gradients are unscaled" lives here, and a new backward ends it: gradients
    still unscaled are multiplied back by the scale they were unscaled with, so that the new, scaled gradients add
    up with them consistently and the next step unscales the sum once. What that earlier unscale found is carried
    too (a device tensor, no sync): value clipping can clamp an inf away, yet the step those gradients feed into must
    still be skipped. A step consumes its record. No state outlives the gradients it describes: if they are gone
    (``zero_grad()``) when the next backward starts, nothing is carried.

    It holds no scaler: the plugin owns the one :class:`DynamicLossScaler` and passes it to each call, so a scaler
    replaced on the plugin (or spied on by a test) is the one used.
    """

    def __init__(self) -> None:
        # id(optimizer) -> (the optimizer, found-inf flag, scale the gradients were unscaled with; None: check-only)
        self._records: dict[int, tuple[Any, Tensor, Optional[Tensor]]] = {}
        # id(optimizer) -> found-inf flag of unscaled gradients that a later backward adds to
        self._carried: dict[int, Tensor] = {}
        # id(optimizer) -> (its parameters and group sizes when grouped; the named parameters grouped by device and
        # dtype): built once, checked against param_groups every step (the same parameters in the same places)
        self._groups: dict[int, tuple[list[Any], list[int], GradientGroups]] = {}

    def unscale(self, scaler: DynamicLossScaler, optimizer: Any, names: dict[int, str]) -> Tensor:
        """Unscale ``optimizer``'s gradients unless already done since their backward; the found-inf flag.
        ``names``: ``id(parameter) -> name`` (a parameter without one is named by its place in ``param_groups``)."""
        key = id(optimizer)
        record = self._records.get(key)
        if record is None:
            scale = scaler.scale_of_grads() if not scaler.check_only else None  # check-only: nothing to scale back
            found_inf = scaler.unscale_(self._grouped_params(optimizer, names))
            carried = self._carried.pop(key, None)
            if carried is not None:
                found_inf = found_inf + carried.to(found_inf.device)
            record = self._records[key] = (optimizer, found_inf, scale)
        return record[1]

    def _grouped_params(self, optimizer: Any, names: dict[int, str]) -> GradientGroups:
        groups = optimizer.param_groups
        flat = [param for group in groups for param in group["params"]]
        cached = self._groups.get(id(optimizer))
        if (  # the same parameters, in the same places (group sizes too: unnamed ones are named by their place)
            cached is None
            or len(cached[0]) != len(flat)
            or not all(map(operator.is_, flat, cached[0]))
            or (len(groups) > 1 and cached[1] != [len(group["params"]) for group in groups])
        ):
            named = [
                (names.get(id(param), f"param_groups[{g}][{i}]"), param)
                for g, group in enumerate(groups)
                for i, param in enumerate(group["params"])
            ]
            cached = (flat, [len(group["params"]) for group in groups], GradientGroups(named))
            self._groups[id(optimizer)] = cached
        return cached[2]

    def is_unscaled(self, optimizer: Any) -> bool:
        """Whether ``optimizer``'s gradients were unscaled since the backward that produced them."""
        return id(optimizer) in self._records

    def consumed(self, optimizer: Any) -> None:
        """The step of ``optimizer`` was decided (taken or skipped): its record ends."""
        self._records.pop(id(optimizer), None)
        self._carried.pop(id(optimizer), None)

    def new_backward(self, scaler: DynamicLossScaler) -> None:
        """A backward is about to add scaled gradients: scale back whatever is still unscaled and carry what its
        check found; end every record."""
        for key, (optimizer, found_inf, scale) in self._records.items():
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            if not grads:  # zero_grad() since: nothing left to scale back or to carry
                continue
            self._carried[key] = found_inf
            if scale is not None and not scaler.check_only:
                with torch.no_grad():
                    for grad in grads:
                        grad.mul_(scale.to(grad.device))
        self._records.clear()

    def clear(self) -> None:
        self._records.clear()
        self._carried.clear()
        self._groups.clear()


# ------------------------------------------------------------------------------------------ helpers
def has_grads(optimizer: Any) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def unwrap_optimizer(optimizer: Any) -> Any:
    # LightningOptimizer (what the user holds in manual optimization) wraps the torch optimizer
    return getattr(optimizer, "_optimizer", optimizer)
