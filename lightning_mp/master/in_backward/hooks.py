"""The lean step inside backward: each parameter is updated as soon as its gradient is final, and the gradient freed.

``MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)``. At setup,
:class:`StepInBackward` registers ``Tensor.register_post_accumulate_grad_hook`` on every parameter of the one
optimizer. During backward, once autograd has accumulated a parameter's gradient, its hook runs the lean update of
that one parameter and sets ``param.grad = None``, through the optimizer's
:class:`~lightning_mp.master.lean.update.LeanUpdate` (the normal step's): for ``torch.optim.AdamW``, ``Adam`` and
``SGD`` the one-parameter replay of the step plan (:mod:`lightning_mp.master.lean.plan`; the same kernel, the same bits
as the normal step, which updates each tensor independently; on the CPU, once laid out, replayed as one C call that
also checks the gradient: :mod:`~lightning_mp.master.in_backward.prepared`), for the table's other optimizers (``NAdam``) the
chunked update of that parameter; for any other optimizer (torchao's ``AdamW8bit``, ...) its own ``step()`` on that
parameter's fp32 slices (:meth:`GenericChunkedStep.run_params
<lightning_mp.master.lean.generic.GenericChunkedStep.run_params>`, per-group counters advanced once per step). An
optimizer whose ``step()`` needs a closure (``LBFGS``) is refused. No gradient outlives its update: at rest a bf16
parameter costs 2 (weight) + 2 (remainder) + the optimizer state, 12 bytes with AdamW, about 6 with ``AdamW8bit``.
Under DDP the gradient is final only after its bucket's all-reduce: the hooks are handed over to DDP's communication
hook (:mod:`lightning_mp.distributed.ddp_in_backward`). Under FSDP2 the hooks sit on the sharded parameters, whose
hooks FSDP2 runs after each reduce-scatter (:mod:`lightning_mp.distributed.fsdp2_in_backward`).

Non-finite values, without a host synchronisation (:mod:`~lightning_mp.master.in_backward.flags`): before backward
:meth:`StepInBackward.begin` writes the loss's device flag into each parameter's slot of one preallocated vector (a
non-finite loss skips every update of the step); each hook adds its own gradient's check to its slot (a non-finite
gradient skips that parameter's update only). :meth:`StepInBackward.finish` reads nothing: the flags are read on the
host only where the step's decision is needed there (:class:`lightning_mp.stepping.OptimizerStep`). Any
other optimizer (the generic path) reads its parameter's flag on the host on a CPU (free); on a GPU it skips on the
device by a masked write-back where :mod:`~lightning_mp.master.lean.generic` can, else reads it: a synchronisation per
parameter.

A parameter's bf16 value is rewritten while backward still runs. Autograd has used it by then in every node that
produces its gradient; a node that saved the parameter without producing its gradient (a ``detach()`` of it in the
forward) would see the new value.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, Optional

from torch import Tensor
from torch.optim import Optimizer

from lightning_mp.master.following import seen
from lightning_mp.master.in_backward.changes import UNDER_REDUCTION, GroupOptions, later_hooks, one_groups
from lightning_mp.master.in_backward.flags import StepFlags
from lightning_mp.master.in_backward.regions import PARTIAL, Regions, current_graph_task
from lightning_mp.master.in_backward.settings import OPTION, accumulation_schedule, refusal, trainer_grad_ops
from lightning_mp.master.in_backward.zero_grads import ZeroGrads
from lightning_mp.master.lean.interface import LeanStore


def check_options(optimizer_in_backward: Any, precision: str, master_weights: Any) -> None:
    """Raise a :func:`refusal` for plugin arguments that cannot step in backward (called by the constructor)."""
    if not isinstance(optimizer_in_backward, bool):
        raise ValueError(f"optimizer_in_backward={optimizer_in_backward!r} must be True or False.")
    if not optimizer_in_backward:
        return
    if precision != "bf16-mixed":
        raise refusal(
            f"needs precision='bf16-mixed', not {precision!r}: fp16 needs loss scaling, whose scale is known to be "
            "right only after every gradient is checked, and lean masters need bf16",
            "Use MixedPrecisionPlugin('bf16-mixed', master_weights='remainder', optimizer_in_backward=True).",
        )
    kind = master_weights.get("kind") if isinstance(master_weights, Mapping) else master_weights
    if kind != "remainder" and getattr(master_weights, "kind", None) != "remainder":
        raise refusal(
            f"needs master_weights='remainder', not {master_weights!r}: the update inside backward is the lean "
            "masters' one-pass update, one parameter at a time",
            "Pass master_weights='remainder' (exact fp32 masters in 4 bytes/param), or optimizer_in_backward=False.",
        )


def check_setup(trainer: Any, model: Any, optimizers: list[Optimizer]) -> None:
    """Raise a :func:`refusal` for a Trainer setup whose updates cannot run inside backward (called at connect,
    before any step; Fabric's ``fabric.setup`` too): several optimizers, an optimizer whose step needs a closure,
    gradient accumulation, clipping by norm. The strategy is refused at ``convert_module``. What shows only at run
    time (a second backward before a step, clipping after backward) is :mod:`lightning_mp.master.in_backward.loop`'s."""
    if not optimizers:  # validate/test/predict (or no optimizer at all): nothing is updated, nothing to refuse
        return
    if len(optimizers) != 1:
        raise refusal(
            f"takes exactly one optimizer, got {len(optimizers)} (from configure_optimizers or fabric.setup): each "
            "parameter's hook steps one optimizer, and several would update a parameter with another's gradients",
            "Return one optimizer (param groups are fine), or use optimizer_in_backward=False.",
        )
    optimizer = getattr(optimizers[0], "_optimizer", optimizers[0])
    if needs_closure(optimizer):
        raise refusal(
            f"cannot step {type(optimizer).__module__}.{type(optimizer).__qualname__}: its step() needs a closure "
            "(it evaluates the loss again, e.g. LBFGS's line search), and inside backward each parameter is updated "
            "once, from its hook, without one",
            "Use an optimizer whose step() takes no closure (AdamW, torchao's AdamW8bit, any other), or "
            "optimizer_in_backward=False for this one.",
        )
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if accumulate != 1:
        raise refusal(
            f"cannot accumulate gradients (accumulate_grad_batches={accumulate}): each gradient is used and freed "
            "in the backward that produced it",
            "Set Trainer(accumulate_grad_batches=1) and a larger batch, or use optimizer_in_backward=False.",
        )
    for callback in getattr(trainer, "callbacks", None) or []:
        schedule = accumulation_schedule(callback)
        if schedule:
            raise refusal(
                f"cannot accumulate gradients, and {type(callback).__name__}(scheduling={schedule}) would raise "
                "Trainer.accumulate_grad_batches above 1 during fit: each gradient is used and freed in the backward "
                "that produced it",
                f"Remove the {type(callback).__name__} callback (use a larger batch instead), or use "
                "optimizer_in_backward=False.",
            )
    trainer_grad_ops(trainer, "at setup")


def needs_closure(optimizer: Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``closure`` argument without a default (torch's ``LBFGS``)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def check_strategy(strategy: Any, fabric: bool = False) -> None:
    """Raise a :func:`refusal` under a strategy other than Lightning's single-device ones, DDP (the Trainer's or
    Fabric's: the updates run once each bucket's all-reduce completed, :mod:`lightning_mp.distributed.ddp_in_backward`)
    and FSDP2 under the Trainer (each shard's update runs right after its reduce-scatter:
    :mod:`lightning_mp.distributed.fsdp2_in_backward`)."""
    name = type(strategy).__name__
    if strategy is None or name in ("SingleDeviceStrategy", "SingleDeviceXLAStrategy"):
        return
    names = {type_.__name__ for type_ in type(strategy).__mro__}
    if fabric and "ModelParallelStrategy" in names:
        raise refusal(
            f"is not available under Lightning Fabric's {name} (FSDP2) yet: it is wired for the Trainer's",
            "Use the Trainer with ModelParallelStrategy, Fabric with strategy='ddp' or devices=1, or "
            "optimizer_in_backward=False with this strategy.",
        )
    if "DeepSpeedStrategy" in names:
        raise refusal(
            f"cannot run under {name}: DeepSpeed's engine owns the masters, the gradient reduction and the step",
            "Use strategy='ddp' (the updates run as each bucket's all-reduce completes), or DeepSpeed's own options.",
        )
    if "ModelParallelStrategy" in names:  # FSDP2: the shards' hooks, agreed skips (fsdp2_in_backward)
        return
    if "DDPStrategy" not in names or "FSDPStrategy" in names:
        raise refusal(
            f"runs on one device, under DDP or FSDP2 only, not under {name} (the update of each parameter needs its "
            "reduced gradient as soon as it is final)",
            "Use strategy='ddp', ModelParallelStrategy or devices=1, or optimizer_in_backward=False with this "
            "strategy.",
        )


class StepInBackward:
    """Per-parameter updates of ``optimizer`` on ``store``'s lean state, run by post-accumulate-grad hooks.

    Args:
        store: the :class:`~lightning_mp.master.RemainderMasters` holding the parameters.
        optimizer: any optimizer over (some of) the store's parameters whose ``step()`` takes no closure.
        clamp: clip each gradient to ``[-clamp, clamp]`` (in fp32, inside the update) before it is used; ``None``
            (default): no clipping.
        check: check the loss and each gradient for inf/NaN and skip what is non-finite (default ``True``).
        names: ``id(parameter) -> name``, for the report of non-finite gradients.
        trainer: the Trainer under automatic optimization, whose settings (accumulation, clipping) are read again
            before each backward (:func:`trainer_grad_ops`); ``None`` (Fabric, manual optimization): ``clamp`` stays.
    """

    def __init__(
        self,
        store: LeanStore,
        optimizer: Optimizer,
        clamp: Optional[float] = None,
        check: bool = True,
        names: Optional[dict[int, str]] = None,
        trainer: Any = None,
    ) -> None:
        self.store = store
        self.trainer = trainer
        self.optimizer = optimizer
        self.grad_ops: list[tuple[str, Any]] = [("clamp", float(clamp))] if clamp else []
        self.check = check
        self.names = names or {}
        self.armed = False  # hooks update only between begin() and finish(): a backward of the plugin's step
        self._flags = StepFlags(self._name)  # one slot per parameter, made once (in_backward_flags)
        self._finished: Optional[StepFlags] = None  # the last finished step's flags, until the next begin()
        self._one_groups: dict[int, tuple[int, dict[str, Any]]] = {}  # id(param) -> (its group's index, its group)
        self._hooks: dict[int, Any] = {}  # id(parameter) -> its post-accumulate-grad hook
        #: the optimizer's update on the store (master/lean/update.py): one-pass, chunked or generic, chosen once
        self.update = store.updates.of(optimizer)
        self._params: list[Tensor] = []  # every parameter of the optimizer; hooked while it requires grad
        self._handed_over: set[int] = set()  # ids of parameters whose updates someone else drives (DDP)
        #: under FSDP2: the loss flag (once, before backward) and each shard's flag (in its hook) summed over the ranks
        #: before any update reads it (:mod:`lightning_mp.distributed.fsdp2_in_backward`); ``None``: rank-local
        self.agree_each: Optional[Callable[[Tensor], Tensor]] = None
        #: reentrant checkpoint regions of the running backward: updates wait for them (in_backward_regions)
        self._regions = Regions()
        self._zero = ZeroGrads()  # the gradients the normal step would hold: zero updates owed (in_backward_zero_grads)
        # one dict per parameter for its whole life: the CUDA kernel caches its address tables by id(group). The
        # group by its index: optimizer.load_state_dict (a resume) replaces the group dicts
        self._one_groups, self._params = one_groups(optimizer, {})
        self._options = GroupOptions(optimizer, self._one_groups)  # each group read once a step, not per parameter
        self._flags.plan(self._params)
        self._zero.plan(self._params, self._handed_over)
        self._groups_at = seen(optimizer).groups  # compared before each backward: any edit of the param groups shows
        self._hook_trainable()

    @property
    def driven_by_strategy(self) -> bool:
        """Whether DDP's communication hook (:meth:`hand_over`) or FSDP2's reduction (:attr:`agree_each`) drives the
        updates: the parameters and the optimizer are fixed at setup then."""
        return bool(self._handed_over) or self.agree_each is not None

    @property
    def skipped_params(self) -> list[str]:
        """Names of the parameters whose non-finite gradient (under a finite loss) skipped their update in the last
        step (what PrecisionMonitor records, the gradients being gone by then): read from the device flags when
        asked, once per step (a host synchronisation on an accelerator unless the step read them already)."""
        return self._finished.read()[1] if self._finished is not None else []

    def _hook_trainable(self) -> None:
        """Hook every parameter that requires grad now and has no hook yet (a frozen one, as LoRA's base weights in
        an optimizer over all parameters, cannot take a hook; one unfrozen later is hooked at the next backward)."""
        for param in self._params:
            if param.requires_grad and id(param) not in self._hooks and id(param) not in self._handed_over:
                self._hooks[id(param)] = param.register_post_accumulate_grad_hook(self._update)

    def begin(self, loss: Optional[Tensor]) -> None:
        """Before backward: arm the hooks; ``loss`` (the tensor backward starts from) becomes the step's device
        flag, nonzero when it is non-finite (then every update of this backward is skipped). Reentrant checkpoint
        regions below ``loss`` make the updates that land while one runs wait for the end of backward
        (:mod:`~lightning_mp.master.in_backward.regions`); under DDP or FSDP2 they are refused here, before backward."""
        # every refusal first, before this backward updates anything: what the Trainer asks now, hooks added later
        if self.trainer is not None:
            self.grad_ops = trainer_grad_ops(self.trainer, "now")
        later_hooks(self._params, self._hooks, self._name, OPTION)
        now = seen(self.optimizer, state=self.update.generic is None)  # what the optimizer reads now (following.py)
        if now.groups != self._groups_at:
            self._follow_groups()
            self._groups_at = now.groups
        # a state edited since the last backward (or made by its updates): every state checked before any update
        self.update.check(now)
        reduced = self.driven_by_strategy  # regions refused: walked every backward
        if self._regions.arm(loss, self._run_waiting, walk=reduced) and reduced:
            self._regions.clear()
            raise RuntimeError(  # before armed: the next backward is not taken for a second one
                f"MixedPrecisionPlugin({OPTION}) cannot follow reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True) under DDP or FSDP2: the parameters' gradients arrive "
                "in parts, one per nested backward, through the strategy's reduction. This backward was stopped before "
                "it updated anything. Pass use_reentrant=False to torch.utils.checkpoint (or "
                "gradient_checkpointing_kwargs={'use_reentrant': False}), or use optimizer_in_backward=False."
            )
        if self.agree_each is not None and self._zero.probe is not None:  # FSDP2: no probe on the reduced shards
            self._zero.plan(self._params, {id(p) for p in self._params})
        self._zero.begin()  # what the user's zero_grad did since the last step
        self.armed = True
        self._finished = None
        if len(self._hooks) + len(self._handed_over) < len(self._params):
            self._hook_trainable()
        self._options.refresh()  # what a scheduler (or a resume) changed since the last step, group by group
        # the generic path's group options advance once in this backward's updates; the fast forms' options are read
        self.update.begin_params(self._one_groups, self.grad_ops, self.agree_each is not None)
        if self.check:
            self._flags.begin(loss, self.agree_each)

    def _follow_groups(self) -> None:
        """Param groups changed since setup (:mod:`~lightning_mp.master.in_backward.changes`): every parameter of
        the current groups gets its one-parameter group (its group's options) and its hook, those no longer in the
        optimizer lose theirs. Under DDP or FSDP2 only a change that keeps the same parameters (reordered, moved
        between groups) is followed."""
        ones, params = one_groups(self.optimizer, self._one_groups)
        if self.driven_by_strategy and ones.keys() != self._one_groups.keys():
            raise RuntimeError(f"MixedPrecisionPlugin({OPTION}) {UNDER_REDUCTION}")
        self.update.follow_groups()  # the generic path slices the new groups (the store's before_backward may have)
        self._one_groups, self._params = ones, params
        self._options = GroupOptions(self.optimizer, self._one_groups)
        self._flags.plan(self._params)
        self._zero.plan(self._params, self._handed_over)
        for key in [key for key in self._hooks if key not in self._one_groups]:
            self._hooks.pop(key).remove()
        self._hook_trainable()

    def hand_over(self, params: list[Tensor]) -> None:
        """Remove the hooks of ``params``: their gradient is final later than autograd says (under DDP, once their
        bucket's all-reduce completed), and whoever knows when calls :meth:`update_with` then."""
        for param in params:
            self._handed_over.add(id(param))
            hook = self._hooks.pop(id(param), None)
            if hook is not None:
                hook.remove()
        self._zero.plan(self._params, self._handed_over)  # no probe among the gradients DDP reduces

    def update_with(self, param: Tensor, grad: Tensor) -> None:
        """The hook's work with ``grad`` (``param``'s final gradient) as ``param.grad``: check, update, free."""
        if self.armed and id(param) in self._one_groups:
            param.grad = grad
            self._update(param)

    def agree_on_loss(self, agree: Any) -> None:
        """Replace this backward's loss flag by ``agree(flag)`` (summed over the ranks, as 0 or 1) before any update
        reads it (under DDP: a non-finite loss on one rank skips the same updates on all)."""
        if self.check:
            self._flags.agree_on_loss(agree)

    def _update(self, param: Tensor) -> None:
        if not self.armed or param.grad is None:
            return
        regions = self._regions
        # the usual hook in a watched backward: in the outer graph task (Regions.nested), nothing waiting; else asked
        if (
            regions.pending or regions.waiting or (regions.watching and current_graph_task() != regions.outer)
        ) and regions.wait(param):
            if regions.watching and id(param) in self._zero.updated:  # updated already: a region met unwalked
                raise RuntimeError(PARTIAL.format(name=self._name(param)))
            return  # reentrant checkpointing: the gradient may not be whole yet, updated at the end of backward
        self._apply(param)

    def _run_waiting(self) -> None:
        """At the end of a backward with reentrant regions: the updates that waited, each with its whole gradient."""
        for param in self._regions.take():
            if self.armed and param.grad is not None:
                self._apply(param)

    def _apply(self, param: Tensor) -> None:
        index, one = self._one_groups[id(param)]  # its group's options as of begin() (GroupOptions.refresh)
        # its check and update: the dispatch of master/lean/update.py (a plan's fast form, the plan, chunked, generic)
        self.update.run_param(param, index, one, self._flags if self.check else None, self.agree_each, self.grad_ops)
        if not self._zero.keeps(param):
            param.grad = None  # the gradient is used: free it now (all but the probe's: in_backward_zero_grads)

    def finish(self) -> Optional[StepFlags]:
        """After backward: disarm the hooks; the step's flags (``None`` without a check), not read: their
        :meth:`~lightning_mp.master.in_backward.flags.StepFlags.read` is one host read, made where needed."""
        self.armed = False
        self._regions.clear()  # a backward with regions ran their updates at its end (none left to wait)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # as torch's step() records for schedulers
        self._zero.settle(self._params, self._apply)  # zero_grad(set_to_none=False): zero updates owed (frozen, unused)
        self.update.end_params()  # what the updates owe after backward (the 8-bit step on CUDA: its step counts)
        left = [
            p
            for g in self.optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and p is not self._zero.probe
        ]
        if left:  # every update ran inside backward and freed its gradient: one left means an update did not run
            names = ", ".join(self._name(p) for p in left[:5])
            raise RuntimeError(
                f"MixedPrecisionPlugin({OPTION}): {len(left)} parameter(s) still hold a gradient after backward "
                f"({names}{', ...' if len(left) > 5 else ''}), so their updates did not run inside backward and the "
                "step would leave them behind. A gradient written outside backward (p.grad = ...), a parameter added to the "
                "optimizer after backward began (add param groups before it, e.g. in on_train_epoch_start), or a strategy "
                "that did not run the parameter's post-accumulate-grad hook (FSDP2 needs torch >= 2.13's), causes "
                "this. Use optimizer_in_backward=False."
            )
        self._finished = self._flags if self.check else None
        return self._finished

    def _name(self, param: Tensor) -> str:
        return self.names.get(id(param), f"parameter {tuple(param.shape)}")

    def remove(self) -> None:
        """Remove the hooks (at teardown)."""
        for hook in self._hooks.values():
            hook.remove()
        self._hooks, self._params = {}, []
        self.update.drop_fast()
        self._regions.clear()
        self.armed = False


def install(
    current: Optional[StepInBackward],
    enabled: bool,
    store: Optional[LeanStore] = None,
    model: Any = None,
    optimizers: Optional[list[Optimizer]] = None,
    check: bool = True,
    names: Optional[dict[int, str]] = None,
) -> Optional[StepInBackward]:
    """The plugin's :class:`StepInBackward` after a connect (or, ``enabled=False``, a teardown): ``current``'s hooks
    removed, new ones on the one optimizer's parameters when ``enabled`` and there is an optimizer (none under
    validate/test/predict). Clipping by value is applied per parameter inside the update (:func:`check_setup` refused
    clipping by norm)."""
    if current is not None:
        current.remove()
    if not enabled or not optimizers:
        return None
    trainer = getattr(model, "_trainer", None)
    clamp = getattr(trainer, "gradient_clip_val", None) or None
    optimizer = getattr(optimizers[0], "_optimizer", optimizers[0])
    automatic = trainer is not None and getattr(model, "automatic_optimization", False)  # the Trainer's clipping
    if store is None:
        raise ValueError("install(enabled=True) needs the lean store the updates run on")
    return StepInBackward(store, optimizer, clamp, check, names, trainer if automatic else None)
