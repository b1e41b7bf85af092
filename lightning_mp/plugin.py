"""``MixedPrecisionPlugin``: Lightning's precision hooks, wired to our loss scaler.

The plugin is glue: numerics live in :mod:`lightning_mp.scaler`, the order of an optimizer step in
:mod:`lightning_mp.stepping`. One automatic-optimization step runs ``forward_context`` (autocast) -> ``pre_backward``
(scale the loss) -> ``optimizer_step`` (closure, unscale, Lightning's hooks and clipping on unscaled grads, step only
if finite, update the scale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator, Mapping
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_mp.averaging import adapt_averaging_callbacks, restore_averaging_callbacks
from lightning_mp.checkpoints.io import warn_if_unloadable
from lightning_mp.diagnostics.half_failure import ExplainingAutocast
from lightning_mp.diagnostics.skipped import SkippedStep
from lightning_mp.distributed import GradientSync, mixed_precision_policy, sync_for
from lightning_mp.distributed.shard import fsdp2_shard
from lightning_mp.distributed.sync import reduce_dtype_of
from lightning_mp.fabric.hooks import FabricHooks
from lightning_mp.forward import ModuleRules, module_policy, override_context, override_targets, warn_at_connect
from lightning_mp.forward import module_device as _module_device
from lightning_mp.fp8.convert import Fp8Training
from lightning_mp.master import MasterWeightsOption, PlainWeights, is_norm, masters_for
from lightning_mp.master.in_backward import check_options, check_strategy
from lightning_mp.policy import CastPolicy
from lightning_mp.scaler import DynamicLossScaler
from lightning_mp.scaler.settings import foreign_scaler_state
from lightning_mp.schedulers import guard_step_schedulers
from lightning_mp.standalone import lightning_isinstance
from lightning_mp.stepping import OptimizerStep, check_zero_grad_after_step

PrecisionName = Literal["16-mixed", "bf16-mixed"]
_DTYPES: dict[str, torch.dtype] = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class MixedPrecisionPlugin(FabricHooks, Precision):  # FabricHooks: the hooks as Fabric calls them
    """Mixed-precision training with a loss scaler you can tune and inspect.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast, default) or ``"bf16-mixed"`` (bf16 autocast, no scaling).
        scaler: for ``16-mixed``: ``None`` for a default :class:`~lightning_mp.DynamicLossScaler`, a
            ``DynamicLossScaler`` you configured, or a number for a static scale (never changes; non-finite
            steps are still skipped), or a mapping of ``DynamicLossScaler`` arguments (for YAML). For
            ``bf16-mixed``: ``None`` (default) checks every step's gradients for inf/NaN and skips a non-finite
            step without scaling (:meth:`DynamicLossScaler.check_only`; check and skip run on the device as in
            fp16, see :mod:`lightning_mp.stepping`); ``DynamicLossScaler(enabled=False)`` or ``{"enabled": False}``
            turns that check off; a
            ``check_only(max_consecutive_skips=...)`` scaler or ``{"max_consecutive_skips": N}`` tunes it. In
            every mode with a check, ``max_consecutive_skips`` non-finite steps in a row raise.
        master_weights: ``True``/``"fp32"``: a half model and fp32 master copies (:class:`~lightning_mp.master.
            MasterWeights`); ``"remainder"`` (bf16): a bf16 model plus 16-bit remainders, the same exact masters in
            less memory (:class:`~lightning_mp.master.RemainderMasters`; options: :func:`~lightning_mp.master.
            masters_for`). Default ``False``: the model stays fp32 and only autocast runs in half.
        keep_norm_fp32: with master weights, normalisation layers keep fp32 parameters (default ``True``).
        policy: the per-op casting policy: a :class:`~lightning_mp.CastPolicy`, a preset name (``"autocast"``,
            the default, ``"conservative"``, ``"fast"``) or a mapping (YAML). A LightningModule may declare its
            own with ``configure_precision_policy()``; it is merged on top (the module wins).
        reduce_dtype: dtype in which gradients are all-reduced across ranks (DDP, FSDP2): ``torch.float32``
            (default, as Megatron: exact sums of half gradients), ``torch.bfloat16`` or ``torch.float16`` (half the
            bytes); names such as ``"bf16"`` work too. No effect on one device. See docs/many-devices.md.
        fp8: ``None`` (default), a torchao recipe name (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``) or
            a ``torchao.float8.Float8LinearConfig``: the policy's eligible ``nn.Linear`` layers train in fp8 (needs
            the ``fp8`` extra; see :mod:`lightning_mp.fp8`). Under FSDP2 shard with :meth:`fsdp2_shard` (it converts).
        optimizer_in_backward: ``True`` (with ``"bf16-mixed"`` and ``master_weights="remainder"``): each parameter is
            updated inside backward as soon as its gradient is final, and the gradient freed (12 bytes/param at rest
            with AdamW; :mod:`lightning_mp.master.in_backward`). Trainer (automatic or manual; one device, DDP,
            FSDP2) and Fabric (one device or DDP), one optimizer whose ``step()`` takes no closure; the step keeps
            the books (:mod:`~lightning_mp.master.in_backward.loop`). Accumulation and clipping by norm are refused.
            Default ``False``.
        zero_grad_after_step: whether to free the gradients of the optimizer a Trainer step updated (or skipped)
            right after that step, with ``optimizer.zero_grad(set_to_none=True)``: what the module's
            ``optimizer_zero_grad`` does anyway before the next backward (Lightning calls it after the next forward),
            so that the next forward's activations and this step's gradients are never alive together (with lean
            masters: peak 15.1 -> 14.0 bytes/param on an HF Llama, ``benchmarks/RESULTS.md``). ``False`` (default):
            never, as Lightning's built-in precision (gradients stay readable in ``on_train_batch_end`` until
            Lightning zeroes them); ``True``: after every step under the Trainer (manual optimization too); ``None``:
            under automatic optimization, unless the module overrides ``optimizer_zero_grad``. The weights are the
            same bits either way. Fabric: your loop's ``zero_grad()``.

    The autocast device is the device the model lives on, found when Lightning connects the plugin; ``fp16``
    is honoured on CPU too (Lightning's built-in switches to bf16 there), with a one-time warning that it is
    slow. A step whose gradients hold inf/NaN is skipped, and LR schedulers with ``interval="step"`` do not
    advance on it. The step does not wait for the device where the optimizer can skip on the device (``fused=True``)
    and no step-interval scheduler or skip observer needs the decision on the host: see :mod:`lightning_mp.stepping`.
    """

    def __init__(
        self,
        precision: PrecisionName = "16-mixed",
        scaler: Union[DynamicLossScaler, float, dict[str, Any], None] = None,
        master_weights: MasterWeightsOption = False,
        keep_norm_fp32: bool = True,
        policy: Union[CastPolicy, str, dict[str, Any], None] = None,
        reduce_dtype: Union[str, torch.dtype] = "float32",
        fp8: Any = None,
        optimizer_in_backward: bool = False,
        zero_grad_after_step: Optional[bool] = False,
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"MixedPrecisionPlugin(precision={precision!r}) is not supported: use one of {sorted(_DTYPES)}."
            )
        check_options(optimizer_in_backward, precision, master_weights)
        self.optimizer_in_backward = optimizer_in_backward
        self._averaging: list[Any] = []  # Lightning's averaging callbacks run over the exact weights, until teardown
        self.precision = precision
        self.dtype = _DTYPES[precision]
        scaler_made = DynamicLossScaler.for_precision(precision, scaler)
        if not isinstance(keep_norm_fp32, bool):
            raise ValueError(f"keep_norm_fp32={keep_norm_fp32!r} must be True or False.")
        self.policy = CastPolicy.coerce(policy)
        self.reduce_dtype = reduce_dtype_of(reduce_dtype)
        self.fp8 = Fp8Training.create(fp8, precision)  # None unless fp8 is set: torchao is imported only then
        self.keep_norm_fp32 = keep_norm_fp32
        # the one owner of the optimizer step and its state (scaler, masters, the strategy's sync, in-backward hooks)
        self.steps = OptimizerStep(scaler_made, None, self, self.follow_model_writes, GradientSync())
        self.steps.zero_grad_after_step = check_zero_grad_after_step(zero_grad_after_step)
        self.masters = masters_for(self.dtype, master_weights, self.params_stay_fp32)
        self._effective_policy = self.policy
        self._overrides: tuple[Optional[CastPolicy], bool] = (None, False)  # (policy, whether it overrides any op)
        self._module_rules = ModuleRules()
        self._device_type: Optional[str] = None

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:  # the step's (lightning_mp.stepping.OptimizerStep)
        return self.steps.scaler

    @scaler.setter
    def scaler(self, scaler: Optional[DynamicLossScaler]) -> None:
        self.steps.scaler = scaler

    @property
    def masters(self) -> Optional[PlainWeights]:  # the step's (None: no master weights)
        return self.steps.masters

    @masters.setter
    def masters(self, masters: Optional[PlainWeights]) -> None:
        self.steps.masters = masters

    @property
    def skip_observers(self) -> list[Callable[..., None]]:
        """Called as ``observer(plugin=, optimizer=, model=)`` on every skipped step, before the scaler updates
        (the diagnostics' extension point: :attr:`lightning_mp.stepping.OptimizerStep.skip_observers`)."""
        return self.steps.skip_observers

    def skipped_step(self) -> SkippedStep:
        """What the diagnostics need of the step being skipped, as a value (a skip observer asks it of ``plugin=``):
        the scale it was skipped at, the scale its gradients carry, the forward context and the exact fp32 weights
        for a replay, and the updates skipped inside backward."""
        scaler = self.scaler
        scaled = scaler is not None and scaler.enabled and not scaler.check_only
        in_backward = self.steps.in_backward
        return SkippedStep(
            scale=float(scaler.scale) if scaler is not None else 1.0,
            grads_scale=float(scaler.scale_of_grads()) if scaler is not None and scaled else 1.0,
            device_type=self.device_type,
            forward_context=self.train_step_context,
            fp32_weights=self.steps.weights.fp32_pairs,  # none without masters
            skipped_in_backward=tuple(in_backward.skipped_params) if in_backward is not None else (),
        )

    @property
    def device_type(self) -> str:
        """The autocast device type: where the model lives once connected (before that: CUDA if present)."""
        if self._device_type is not None:
            return self._device_type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def master_weights(self) -> bool:
        """Whether the model is held in half precision with fp32 master weights (flat copies or lean remainders)."""
        return self.steps.weights.holds_masters

    # ------------------------------------------------------------------ the casting policy
    def keeps_fp32(self, name: str, module: Module) -> bool:
        """Whether module ``name`` runs in fp32 (inputs upcast, autocast off) and, with master weights, keeps fp32
        parameters. Default: the policy's ``fp32_modules`` rules. Override this one method to decide per module."""
        return self._effective_policy.module_in_fp32(name, module)

    def params_stay_fp32(self, name: str, module: Module) -> bool:
        """Whether module ``name``'s own parameters stay fp32 with master weights (norms with ``keep_norm_fp32``,
        and what :meth:`keeps_fp32` keeps)."""
        return (self.keep_norm_fp32 and is_norm(name, module)) or self.keeps_fp32(name, module)

    def resolve_policy(self, module: Module) -> None:
        """Merge ``module``'s ``configure_precision_policy()`` into the plugin's policy (at setup, and where a
        strategy converts or shards before connect)."""
        self._effective_policy = self.policy  # until the module's configure_precision_policy() has answered
        self._effective_policy = module_policy(self.policy, module)

    @property
    def effective_policy(self) -> CastPolicy:
        """The plugin's policy merged with the LightningModule's ``configure_precision_policy()``, once connected;
        printed for the device the run uses."""
        return self._effective_policy.for_device(self.device_type)

    def fsdp2_policy(self, name: str = "", module: Optional[Module] = None) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` matching this plugin, for ``fully_shard(..., mp_policy=...)`` in
        ``configure_model``; see :func:`lightning_mp.distributed.mixed_precision_policy`."""
        return mixed_precision_policy(self, name, module)

    def fp8_convert(self, module: Module) -> Module:
        """Convert ``module``'s eligible layers to fp8 now: under FSDP2, in ``configure_model`` before fully_shard."""
        if self.fp8 is None:
            raise ValueError("fp8_convert() converts layers to fp8, but this plugin has fp8=None: pass fp8=...")
        self.resolve_policy(module)  # the module's configure_precision_policy() counts here too
        return self.fp8.convert(module, self, getattr(getattr(module, "_trainer", None), "strategy", None))

    def fsdp2_shard(self, module: Module, blocks: Any = (), root: Any = None, mesh: Any = None, **kw: Any) -> Module:
        """In ``configure_model``: fp8 conversion (with ``fp8=``), then ``fully_shard`` of the fp32 modules, of the
        ``blocks``, then of the ``root``, with this plugin's policies. See :mod:`lightning_mp.distributed.shard`."""
        return fsdp2_shard(self, module, blocks, root, mesh, **kw)

    # ------------------------------------------------------------------ setup
    @override
    def convert_module(self, module: Module) -> Module:
        # Runs once per fit/validate/test/predict, before the model moves to its device and before
        # configure_optimizers, so the optimizers are built on the half parameters and connect() swaps in masters.
        # The conversion is in place: DDP discards the returned module. Under FSDP2 its sharded fp32 parameters are
        # the masters (nothing converted) or, lean, the shards are split (lightning_mp.distributed.fsdp2_lean).
        self.resolve_policy(module)
        strategy = self._strategy_for(module)  # the Trainer's, or a Fabric's (then driven: lightning_mp.fabric)
        if self.optimizer_in_backward:
            check_strategy(strategy, fabric=self._fabric is not None)
        self.steps.sync = sync_for(strategy, self)
        self.masters = self.steps.sync.adopt(self.masters)  # FSDP2: lean masters on the local shards
        if self.fp8 is not None:  # before the masters: Float8Linear keeps the parameters, the masters see them
            self.fp8.convert(module, self, strategy)
        return self.steps.weights.convert(module)

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        # Runs after the model is on its device and the optimizers exist, before checkpoint state is restored.
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self._device_type = _module_device(inner).type
        self.steps.names = {id(param): name for name, param in inner.named_parameters()}
        self.resolve_policy(inner)
        self._module_rules.install(inner, self.keeps_fp32, self._device_type)
        # the masters on the optimizers, the step inside backward on them (refusals first); followed at each step
        # where the Trainer's strategy holds others (an optimizer swapped mid-fit: _follow_optimizers)
        self.steps.hold(getattr(inner, "_trainer", None), inner, optimizers, self.optimizer_in_backward)
        if self.fp8 is not None:
            self.fp8.connect(inner, optimizers)  # FSDP2 fp8 all-gather: weight scales precomputed after each step
        self.steps.sync.connect(model, self)  # DDP: comm hooks (updates after each bucket), masters from rank 0; FSDP2
        if self.scaler is not None:
            self.scaler.gather_names = self.steps.sync.gather_names  # culprits at min_scale, from every rank
        self.steps.unscaled.clear()
        self.start_following_writes(model)  # setup is over: every later write into the model reaches the masters
        self._averaging = adapt_averaging_callbacks(inner, self.steps.weights)  # SWA, EMA over the exact weights
        warn_at_connect(self._effective_policy, inner, self._device_type, self.dtype)  # rules matching nothing, fp16
        trainer = getattr(inner, "_trainer", None)  # torchao's state: checkpoints Lightning's own IO cannot load
        driven = self._fabric.strategy if self._fabric is not None else None
        warn_if_unloadable(trainer.strategy if trainer is not None else driven, optimizers)
        guard_step_schedulers(lr_schedulers)  # they do not advance on a skipped step
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ forward and backward
    def autocast_context_manager(self) -> torch.autocast:
        """The ``torch.autocast`` context used for every forward (train, validation, test, predict). An op that
        cannot run in half precision leaves it as a :class:`~lightning_mp.diagnostics.half_failure.
        HalfPrecisionError` naming the module, the op and the policy line that fixes it (nothing runs otherwise)."""
        return ExplainingAutocast(self.device_type, self.dtype, self._effective_policy)

    @override
    def forward_context(self) -> Any:  # a context manager
        # autocast alone on the default path, not wrapped (it is entered twice a step); op overrides add a mode.
        # Whether there are any is known once per policy object, not hashed again at every forward
        if self._overrides[0] is not self._effective_policy:
            self._overrides = (self._effective_policy, bool(override_targets(self._effective_policy, self.dtype)))
        if not self._overrides[1]:
            return self.autocast_context_manager()
        return self._forward_with_overrides()

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        # a training_step may free the masters' gradients itself (opt.zero_grad() after opt.step() in manual
        # optimization): the gradients the model shows go with them before the hooks that follow (on_train_batch_end)
        try:
            with self.forward_context():
                yield
        finally:
            self.steps.weights.follow_shown_grads()

    @contextlib.contextmanager
    def _forward_with_overrides(self) -> Generator[None, None, None]:
        with self.autocast_context_manager(), override_context(self._effective_policy, self.device_type, self.dtype):
            yield

    def _follow_optimizers(self) -> None:
        # an optimizer swapped mid-fit is the one stepped (masters, hooks inside backward): an identity check per step
        optimizers, module = self.steps.held.follow(), self.steps.held.module  # (optimizers: a module is held)
        if optimizers is not None and module is not None and self.fp8 is not None:  # FSDP2 fp8: scales after steps
            self.fp8.connect(module, optimizers)

    # (the Trainer's signatures: Lightning's own Precision narrows Fabric's base the same way, ignored there too)
    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # scale before Lightning's on_before_backward hooks, as its built-in plugin does. A new backward ends
        # every "already unscaled" record: gradients still unscaled are scaled back so the sum stays consistent
        self._follow_optimizers()
        self.steps.weights.before_backward()  # lean masters: gradients of earlier micro-batches add up in fp32
        self.steps.sync.before_backward()  # DDP, lean masters: fp32 sums move aside before a synchronising backward
        if self.steps.checking:
            assert self.scaler is not None
            self.steps.new_backward()
            tensor = self.scaler.scale_loss(tensor)
        tensor = super().pre_backward(tensor, module)
        if self.steps.in_backward is not None:  # the updates run in this backward (one per step): writes reach
            self.steps.begin_backward(tensor)  # the masters first; the loss checked on the device (non-finite: none)
        return tensor

    @override  # (the Trainer's signature, as pre_backward)
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # on_after_backward hooks see the backward's gradients; then, with fp32 masters, the half ones move to the
        # masters (adding up across accumulated micro-batches in fp32), are freed, and the model shows the masters'
        # fp32 gradients as its own p.grad (views: user code reads them where Lightning's built-in has them)
        self.steps.sync.backward_finished()  # DDP, lean masters: the reduced fp32 sums become the gradients
        closure_loss = super().post_backward(tensor, module)
        if self.steps.weights.moves_grads:  # fp32 masters (no call per step for the others' no-op)
            self.steps.weights.grads_to_masters()
        self.steps.sync.after_backward()  # DDP with masters: reduce the fp32 master gradients once DDP would have
        return closure_loss

    # ------------------------------------------------------------------ the optimizer step
    @override  # (the Trainer's signature, as pre_backward; an Optimizable, where Lightning's says any Steppable)
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizable, model: LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # the order of a step (closure, unscale and check once, agree across ranks, Lightning's hooks and clipping,
        # step or skip, masters back into the model, update the scale) is the step owner's (lightning_mp.stepping)
        self._follow_optimizers()

        def plain_step() -> Any:  # Lightning's own, for the step without a check (made, not called, every step)
            return super(MixedPrecisionPlugin, self).optimizer_step(optimizer, model=model, closure=closure, **kwargs)

        output = self.steps.closure_step(optimizer, model, closure, kwargs, plain_step, self._after_closure)
        self.steps.zero_grad_after(optimizer, model)  # zero_grad_after_step
        return output

    @override
    def _after_closure(self, model: Any, optimizer: Any) -> None:
        # the last thing before every update of the Trainer's paths (stepping's, and Lightning's own closure):
        # writes into the model since the last step reach the masters here, before the step updates them
        super()._after_closure(model, optimizer)
        self.follow_model_writes()
        if self.steps.weights.moves_grads:  # and what the hooks did to the gradients the model shows
            self.steps.weights.follow_shown_grads()

    @override
    def _clip_gradients(
        self, model: Any, optimizer: Any, clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        # Lightning's asks isinstance(model, lightning.pytorch.LightningModule): under the standalone pytorch_lightning
        # Trainer (lightning_mp.pytorch_lightning) it would skip the Trainer's gradient_clip_val without a word
        if (isinstance(model, LightningModule) or lightning_isinstance(model, LightningModule)) and (
            model.automatic_optimization
        ):
            hook = dict(gradient_clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)
            call._call_lightning_module_hook(model.trainer, "configure_gradient_clipping", optimizer, **hook)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        self.steps.refuse_clipping(clip_val, gradient_clip_algorithm, "self.clip_gradients")  # grads gone
        self.steps.unscale_before_clipping(optimizer, clip_val)  # manual optimization: clipping sees true grads
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.steps.clip_by_value(optimizer, clip_val)  # lean masters: in fp32, inside their update

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        self.steps.clip_by_norm(optimizer, clip_val)

    # ------------------------------------------------------------------ the weights, for the code around the step
    def start_following_writes(self, model: Optional[Module] = None) -> None:
        """Setup is over: from now on every write into ``model`` reaches the masters (:meth:`follow_model_writes`)."""
        self.steps.weights.start_following(model)

    def follow_model_writes(self) -> None:
        """Make the master weights follow every write into the model since the plugin's last step (a load into
        any submodule, ``nn.init``, ``copy_`` under ``no_grad``, ``p.data = t``, a replaced parameter), or raise
        :class:`~lightning_mp.master.model_sync.ModelWriteError` naming a parameter they cannot follow. Runs before
        each optimizer step, each save and at teardown (see docs/master-weights.md, "Writes after setup")."""
        sync = self.steps.weights.model_sync  # (the weights' follow_writes, without its frame: every step)
        if sync is not None:
            sync.follow()

    def exact_weights(self, module: Module, write: bool = True) -> contextlib.AbstractContextManager[Module]:
        """A context inside which ``module.parameters()`` are fp32 parameters holding the exact master values, and
        what is written into them becomes the masters on leaving (``write=False``: read only). ``module``: the model
        or any module of it (``self.unet``); one these masters do not hold raises
        :class:`~lightning_mp.master.exact.NotHeldError`; without master weights the parameters are given as they
        are (they are the exact weights). See :func:`lightning_mp.master.exact_weights` and docs/master-weights.md,
        "Weight averaging and EMA teachers"."""
        return self.steps.weights.exact_weights(module, write=write)

    def exact_parameters(self, module: Module) -> Iterator[tuple[str, Tensor]]:
        """``(name, exact fp32 value)`` per parameter of ``module`` (the model or any module of it), one at a time (the
        master itself with ``master_weights=True``, a joined fp32 tensor with ``"remainder"``; without master weights
        the parameters as they are): :func:`lightning_mp.master.exact_parameters`."""
        return self.steps.weights.exact_parameters(module)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any], source: Optional[str] = None) -> None:
        if "scaler" not in state_dict or self.scaler is None:
            return
        source = source or f"checkpoint[{type(self).__qualname__!r}]"
        saved = state_dict["scaler"]
        if isinstance(saved, Mapping) and bool(saved.get("check_only", False)) != self.scaler.check_only:
            rank_zero_warn(
                f"{source}['scaler'] was written by a {'bf16 (check-only)' if saved.get('check_only') else 'fp16'} "
                f"run; this run is {self.precision}, so its scaler keeps its own settings ({self.scaler!r})."
            )
            return
        self.scaler.load_state_dict(saved, source=f"{source}['scaler']")

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning restores plugin state from the key named after this exact class. Resuming with another
        # subclass of this plugin than the one that saved, or from Lightning's built-in MixedPrecision, would
        # silently restart the scale at init_scale: pick up those states here instead.
        if type(self).__qualname__ in checkpoint or self.scaler is None:
            return
        found = foreign_scaler_state(checkpoint, hysteresis=self.scaler.hysteresis)
        if found is not None:
            self.load_state_dict(found[0], source=found[1])

    @override
    def teardown(self) -> None:
        # after fit/validate/test/predict the model holds its fp32 values again (the masters, after training)
        self.steps.held.release()  # the hooks inside backward removed, no optimizer followed
        restore_averaging_callbacks(self._averaging)
        self._averaging = []
        self.steps.weights.restore()
        self._module_rules.remove()
        super().teardown()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(precision={self.precision!r}, scaler={self.scaler!r}, "
            f"master_weights={self.steps.weights.option!r}, "
            + ("optimizer_in_backward=True, " if self.optimizer_in_backward else "")
            + f"policy={self.policy!r}"
            + (f", fp8={self.fp8.recipe!r})" if self.fp8 is not None else ")")
        )
