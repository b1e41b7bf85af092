"""The order of one optimizer step, in one class that owns the state it uses: :class:`OptimizerStep`.

The plugin (Trainer and Fabric, automatic and manual optimization, the step inside backward) hands every optimizer
step to its one :class:`OptimizerStep`, which runs, in this order:

1. the closure (forward, backward: ``pre_backward`` scaled the loss); under Fabric the backward already ran;
2. unscale the gradients once since their backward and check them for inf/NaN (:class:`UnscaledGradients`: early
   unscales, by clipping in manual optimization, are not repeated); the found-inf flag is a device tensor;
3. agree on the flag across ranks (the strategy's ``GradientSync.agree``: one all-reduce of the device tensor);
4. Lightning's ``on_before_optimizer_step`` hooks and gradient clipping, on the unscaled gradients;
5. step the optimizer or skip the step, through the masters' one interface (:meth:`~lightning_mp.master.plain.
   PlainWeights.step`: the flat fp32 masters copy back to the model, the lean ones update themselves);
6. update the scale (``DynamicLossScaler.update``).

With ``optimizer_in_backward=True`` the backward performed the updates; the step keeps the books.

A step's found-inf flag is a device tensor, and the step reads it on the host (one synchronisation, together with
the scaler's pending state) only where the decision is needed there:

  * the update cannot skip on the device (:meth:`~lightning_mp.master.plain.PlainWeights.skips_on_device`). An exact
    skip of, say, the for-loop AdamW on the device would need a copy of the parameters and the optimizer state
    before each step and a ``torch.where`` after it: more work and memory than the one read it saves;
  * a scheduler with ``interval="step"`` is guarded on this optimizer (it must not advance on a skipped step, and it
    is stepped on the host right after the optimizer);
  * a skip observer is registered (``PrecisionMonitor(localise_overflows=True)`` replays the skipped step while its
    batch, gradients and parameters are those of that step);
  * the flag lives on the CPU (CPU training): there is no device to wait for, reading it is a memory read, and the
    small tensor ops of the device path cost more host time than the branch they replace (measurements in
    ``benchmarks/RESULTS.md``). :data:`DECIDE_CPU_FLAGS_ON_HOST` turns this off (the tests and
    ``benchmarks/host_work.py`` do, to run the accelerators' path on CPU tensors).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import LBFGS

from lightning_mp.grads import GradientGroups
from lightning_mp.master.following import seen
from lightning_mp.master.held_optimizers import HeldOptimizers
from lightning_mp.master.in_backward import loop as in_backward_loop
from lightning_mp.master.plain import PLAIN, PlainWeights
from lightning_mp.scaler import DynamicLossScaler
from lightning_mp.schedulers import has_step_scheduler, record_step

#: Decide on the host when the found-inf flag is a CPU tensor (no device to wait for; see the module docstring).
DECIDE_CPU_FLAGS_ON_HOST = True

LBFGS_REFUSED = (
    "MixedPrecisionPlugin with an inf/NaN check or master weights cannot drive LBFGS: it re-evaluates the closure "
    "inside step(), where gradients cannot be checked and the half model is stale. Use "
    "MixedPrecisionPlugin('bf16-mixed', scaler={'enabled': False}) without master weights, or fp32."
)


class OptimizerStep:
    """The one owner of an optimizer step's order and of the state the step uses (module docstring).

    Args:
        scaler: the loss scaler (``None``: no scaling and no check).
        masters: the master weights (``None``: the model's own parameters are updated).
        plugin: what skip observers receive as ``plugin=`` (the precision plugin that owns this step); opaque here,
            so typed ``object``: the step uses nothing of it.
        follow_writes: called before every update: writes into the model since the last step reach the masters.
        sync: what the strategy needs at each step (:mod:`lightning_mp.distributed`; the plugin replaces it when it
            learns the strategy): the agreement on the flag across ranks.

    Attributes:
        unscaled: which optimizers' gradients are unscaled since their backward.
        names: ``id(parameter) -> name`` (masters too), for messages naming parameters.
        in_backward: the step inside backward (:class:`~lightning_mp.master.in_backward.StepInBackward`) or ``None``.
        skip_observers: called as ``observer(plugin=, optimizer=, model=)`` on every skipped step, after the check
            and before the scaler updates; while one is registered the skip is decided on the host.
    """

    def __init__(
        self,
        scaler: Optional[DynamicLossScaler],
        masters: Optional[PlainWeights],
        plugin: object,
        follow_writes: Callable[[], None],
        sync: Any,
    ) -> None:
        self.scaler = scaler
        self.masters = masters
        self.plugin = plugin
        self.follow_writes = follow_writes
        self.sync = sync
        self.unscaled = UnscaledGradients()
        self.names: dict[int, str] = {}
        self.in_backward: Optional[Any] = None  # a StepInBackward (master.in_backward), from connect to teardown
        self.skip_observers: list[Callable[..., None]] = []
        self.held = HeldOptimizers(self)  # the optimizers the masters and the hooks inside backward are on
        self.zero_grad_after_step: Optional[bool] = False  # the plugin's setting (zero_grad_after)

    @property
    def checking(self) -> bool:
        """Whether gradients are unscaled and checked for inf/NaN each step (fp16 scaling, or bf16's check)."""
        return self.scaler is not None and self.scaler.enabled

    @property
    def weights(self) -> PlainWeights:
        """The masters, or the model's own parameters behind the same interface (step, clip)."""
        return self.masters if self.masters is not None else PLAIN

    # ------------------------------------------------------------------------------------------ the step
    def closure_step(
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        kwargs: dict[str, Any],
        plain_step: Callable[[], Any],
        after_closure: Callable[[Any, Any], None],
    ) -> Any:
        """The Trainer's step (automatic and manual optimization): ``closure`` runs forward and backward,
        ``after_closure(model, optimizer)`` Lightning's hooks and clipping; ``plain_step`` is Lightning's own (all
        of it inside ``optimizer.step``), for the step without a check."""
        if self.in_backward is not None:  # the updates ran inside the closure's backward: bookkeeping only
            closure_result = closure()
            after_closure(model, optimizer)
            self._finish_in_backward(optimizer, model)  # nothing when no backward ran
            return closure_result
        self._refuse_lbfgs(optimizer, MisconfigurationException)
        torch_optimizer = unwrap_optimizer(optimizer)
        if not self.checking:
            if not self.weights.updates_itself:  # Lightning's own step, then the flat masters into the model
                return self.weights.step(torch_optimizer, None, plain_step)
            closure()
            after_closure(model, optimizer)
            return self.weights.step(torch_optimizer, None, None)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, so nothing to unscale or step. Hooks and clipping
            # still run, as in Lightning; whatever they unscale stays recorded until the next backward ends it
            after_closure(model, optimizer)
            return None
        # unscale after the closure and before on_before_optimizer_step, so hooks and clipping see true grads
        found_inf = self.sync.agree(self.unscale_once(torch_optimizer))  # every rank takes the same decision
        after_closure(model, optimizer)
        self.unscaled.consumed(torch_optimizer)
        return self._step_or_skip(optimizer, model, found_inf, kwargs)

    def zero_grad_after(self, optimizer: Any, model: Any) -> None:
        """After a Trainer step of ``optimizer`` (taken or skipped): free its gradients where the plugin's
        ``zero_grad_after_step`` says so. ``False`` (default): never, as Lightning's built-in precision (its
        ``optimizer_zero_grad`` frees them after the next forward). ``True``: after every Trainer step. ``None``:
        under automatic optimization, where Lightning's own ``optimizer_zero_grad`` (``optimizer.zero_grad()``, which
        sets them to ``None``) would free the same gradients before the next backward anyway, only after the next
        forward: the module must not override it (it may zero less, or later, on purpose). Inside backward the
        gradients are freed as they are used: nothing is left. The model's gradients go with the masters'."""
        setting = self.zero_grad_after_step
        if setting is False or self.in_backward is not None:
            return
        if setting is None and (not getattr(model, "automatic_optimization", False) or overrides_zero_grad(model)):
            return
        unwrap_optimizer(optimizer).zero_grad(set_to_none=True)
        self.weights.follow_shown_grads()  # fp32 masters: the gradients the model shows are freed too

    def step_after_backward(self, optimizer: Any, model: Any, kwargs: dict[str, Any]) -> Any:
        """The step when the backward already ran (Lightning Fabric's ``optimizer.step()``: no closure), in the order
        of :meth:`closure_step` after its closure."""
        self.follow_writes()  # writes into the model since the last step reach the masters before the update
        self.weights.follow_shown_grads()  # and what the loop did to the gradients the model shows
        if self.in_backward is not None:  # fabric.backward performed the updates: bookkeeping only
            self._finish_in_backward(optimizer, model)  # a skip goes to the skip observers too
            return None
        self._refuse_lbfgs(optimizer, TypeError)
        if not self.checking:
            return self.weights.step(optimizer, None, lambda: optimizer.step(**kwargs))
        found_inf = self.sync.agree(self.unscale_once(optimizer))  # every rank takes the same decision
        self.unscaled.consumed(optimizer)
        return self._step_or_skip(optimizer, model, found_inf, kwargs)

    def _refuse_lbfgs(self, optimizer: Any, error: type[Exception]) -> None:
        if isinstance(unwrap_optimizer(optimizer), LBFGS) and (self.checking or self.weights.holds_masters):
            raise error(LBFGS_REFUSED)

    def _step_or_skip(self, optimizer: Any, model: Any, found_inf: Tensor, kwargs: dict[str, Any]) -> Any:
        """Once the gradients are unscaled and checked (``found_inf``: the flag every rank agreed on): skipped on
        the device where the update can and nothing needs the decision on the host (module docstring); otherwise
        the flag is read here, once, with the scaler's state. Then the scaler updates."""
        scaler: DynamicLossScaler = self.scaler  # type: ignore[assignment]  # checking: a scaler
        torch_optimizer = unwrap_optimizer(optimizer)
        observers = self.skip_observers
        on_host = observers or (DECIDE_CPU_FLAGS_ON_HOST and found_inf.is_cpu)
        weights = self.weights
        if not on_host and weights.skips_on_device(torch_optimizer) and not has_step_scheduler(torch_optimizer):
            flag = found_inf.clamp(max=1.0)  # 0-dim, exactly 0 or 1 (a sum over ranks may exceed 1): fused kernels
            record_step(torch_optimizer, flag)
            output = weights.step(torch_optimizer, flag, _flagged_step(optimizer, torch_optimizer, flag, kwargs))
            scaler.update(found_inf)
            return output
        skip = scaler.read_found_inf(found_inf)  # the step's one host synchronisation
        record_step(torch_optimizer, skip)
        output = None if skip else weights.step(torch_optimizer, None, lambda: optimizer.step(**kwargs))
        for observer in observers if skip else ():  # the diagnostics extension point
            observer(plugin=self.plugin, optimizer=torch_optimizer, model=model)
        scaler.update(skip)
        return output

    # ------------------------------------------------------------------------------------------ unscale and clip
    def unscale_once(self, optimizer: Any) -> Tensor:
        """Unscale ``optimizer``'s grads unless already done since their backward; the found-inf flag tensor. What
        code did to the gradients the model shows is followed first (the masters' are the ones unscaled)."""
        assert self.scaler is not None
        weights = self.weights
        if weights.moves_grads:
            weights.follow_shown_grads()
        return self.unscaled.unscale(self.scaler, unwrap_optimizer(optimizer), self.names)

    def new_backward(self) -> None:
        """A backward is about to add scaled gradients: gradients still unscaled are scaled back."""
        assert self.scaler is not None
        self.unscaled.new_backward(self.scaler)

    def unscale_before_clipping(self, optimizer: Any, clip_val: float) -> None:
        """Clipping asked by the user's code (``self.clip_gradients`` in manual optimization, before ``opt.step()``,
        or ``fabric.clip_gradients``): unscale now so clipping sees true gradients; the step does not unscale
        twice. Fused optimizers need no special case: their step() is always called on unscaled gradients."""
        if clip_val and self.checking and has_grads(optimizer):
            self.unscale_once(optimizer)

    def clip_by_norm(
        self, optimizer: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip by the total norm of the (unscaled) gradients the update uses: the fp32 master gradients where there
        are masters (lean ones clip inside their update); returns the total norm. ``error_if_nonfinite`` raises for
        a non-finite norm only without an inf/NaN check (with one, that step is skipped instead)."""
        check = error_if_nonfinite and not self.checking
        self.weights.follow_shown_grads()
        return self.weights.clip_grad_norm_(unwrap_optimizer(optimizer), max_norm, norm_type, error_if_nonfinite=check)

    def clip_by_value(self, optimizer: Any, clip_val: float) -> None:
        """Clamp the gradients the update uses to ``[-clip_val, clip_val]``; nothing without gradients (a
        training_step that returned None: torch's value clipping fails there)."""
        self.weights.follow_shown_grads()
        if has_grads(optimizer):
            self.weights.clip_grad_value_(unwrap_optimizer(optimizer), clip_val)

    # ------------------------------------------------------------------------------------------ inside backward
    def begin_backward(self, loss: Tensor) -> None:
        """In ``pre_backward``, before a backward that performs the updates: refuse a second backward before the
        step (:data:`~lightning_mp.master.in_backward.loop.SEVERAL_BACKWARDS`), make writes into the model so far
        reach the masters, then arm the hooks with the loss's device check (a non-finite loss skips every update)."""
        in_backward = self.in_backward
        assert in_backward is not None  # (called only with the step inside backward)
        if in_backward.armed:  # armed since the last backward, and no step has finished it
            raise RuntimeError(in_backward_loop.SEVERAL_BACKWARDS)
        self.follow_writes()
        in_backward.begin(loss)

    def _finish_in_backward(self, optimizer: Any, model: Any) -> bool:
        """The step after a backward that performed the updates: LR schedulers held on a skipped step, the scaler's
        count of skipped steps, and, where the flags are read (the module docstring's rule: one host read), the
        report of non-finite values. ``False`` (nothing done) when no backward ran since the last step. A step with a
        skipped update goes to the skip observers (PrecisionMonitor replays it; the replay updates nothing)."""
        in_backward = self.in_backward
        if in_backward is None or not in_backward.armed:
            return False
        flags = in_backward.finish()
        torch_optimizer = unwrap_optimizer(optimizer)
        if flags is None:  # no check: nothing skipped
            record_step(torch_optimizer, False)
            return True
        scaler: DynamicLossScaler = self.scaler  # type: ignore[assignment]  # flags: a check, so a scaler
        observers = self.skip_observers if model is not None else []
        if not (observers or has_step_scheduler(torch_optimizer) or (DECIDE_CPU_FLAGS_ON_HOST and flags.on_cpu)):
            record_step(torch_optimizer, flags.loss())  # a non-finite loss skipped every update; read if ever needed
            scaler.update(flags.found())  # on the device; max_consecutive_skips counts both kinds of skip
            return True
        skipped, names = flags.read()  # the step's one host read
        record_step(torch_optimizer, skipped)
        if names:
            rank_zero_warn(in_backward_loop.skipped_updates_message(names))
        for observer in observers if skipped or names else ():
            observer(plugin=self.plugin, optimizer=torch_optimizer, model=model)
        scaler.update(skipped or bool(names))  # max_consecutive_skips counts both
        return True

    def refuse_clipping(self, clip_val: Optional[float], algorithm: Any, call: str) -> None:
        """With the step inside backward, clipping asked after backward is refused (:func:`~lightning_mp.master.
        in_backward_loop.refuse_clipping`); ``call`` says how the user asked."""
        if self.in_backward is not None:
            in_backward_loop.refuse_clipping(self.in_backward, clip_val, algorithm, call)

    # ------------------------------------------------------------------------------------------ the optimizers
    def hold(self, trainer: Any, module: Any, optimizers: list[Any], in_backward: bool) -> None:
        """At connect: the masters and the step inside backward on ``optimizers``; the ``trainer``'s strategy is
        followed (:class:`~lightning_mp.master.held_optimizers.HeldOptimizers`)."""
        self.held.hold(trainer, module, [unwrap_optimizer(o) for o in optimizers], in_backward)

    def add_optimizer(self, module: Any, optimizers: list[Any]) -> None:
        """An optimizer set up after the module connected (Fabric): :meth:`~lightning_mp.master.held_optimizers.
        HeldOptimizers.add`."""
        self.held.add(module, optimizers)


def _flagged_step(optimizer: Any, torch_optimizer: Any, flag: Tensor, kwargs: dict[str, Any]) -> Callable[[], Any]:
    """``optimizer.step`` under ``torch.amp.GradScaler``'s protocol: gradients already unscaled (``grad_scale``
    ``None``), skipped where ``found_inf`` is 1."""

    def run() -> Any:
        torch_optimizer.grad_scale, torch_optimizer.found_inf = None, flag
        try:
            return optimizer.step(**kwargs)
        finally:
            del torch_optimizer.grad_scale, torch_optimizer.found_inf

    return run


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
        # id(optimizer) -> (its groups' generation when grouped, the named parameters grouped by device and dtype)
        self._groups: dict[int, tuple[int, GradientGroups]] = {}

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
        # made again whenever the groups changed (following.seen: the same parameters in the same places, so that
        # unnamed ones, named by their place, keep their names)
        generation = seen(optimizer).groups
        cached = self._groups.get(id(optimizer))
        if cached is None or cached[0] != generation:
            named = [
                (names.get(id(param), f"param_groups[{g}][{i}]"), param)
                for g, group in enumerate(optimizer.param_groups)
                for i, param in enumerate(group["params"])
            ]
            cached = self._groups[id(optimizer)] = (generation, GradientGroups(named))
        return cached[1]

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


def check_zero_grad_after_step(value: Any) -> Optional[bool]:
    """The plugin's ``zero_grad_after_step``, checked: ``False``, ``True`` or ``None``."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            f"MixedPrecisionPlugin(zero_grad_after_step={value!r}) is not supported: use False (the default: keep "
            "the gradients until Lightning's zero_grad, as its built-in precision), True (free them after every "
            "Trainer step) or None (after each step under automatic optimization unless the module overrides "
            "optimizer_zero_grad)."
        )
    return value


def overrides_zero_grad(model: Any) -> bool:
    """Whether ``model``'s class (a LightningModule of ``lightning`` or ``pytorch_lightning``) defines its own
    ``optimizer_zero_grad``."""
    for cls in type(model).__mro__:
        if "optimizer_zero_grad" in cls.__dict__:
            return not cls.__module__.startswith(("lightning.pytorch.", "pytorch_lightning."))
    return False


def has_grads(optimizer: Any) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def unwrap_optimizer(optimizer: Any) -> Any:
    # LightningOptimizer (what the user holds in manual optimization) wraps the torch optimizer
    return getattr(optimizer, "_optimizer", optimizer)
