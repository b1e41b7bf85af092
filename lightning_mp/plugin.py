"""``MixedPrecisionPlugin``: Lightning's precision hooks, wired to our loss scaler.

The plugin is glue: numerics live in :mod:`lightning_mp.scaler`. One automatic-optimization step runs
``forward_context`` (autocast) -> ``pre_backward`` (scale the loss) -> ``optimizer_step`` (closure, unscale,
Lightning's hooks and clipping on unscaled grads, step only if finite, update the scale).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from functools import partial
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_mp.distributed import GradientSync, mixed_precision_policy, sync_for
from lightning_mp.distributed.sync import reduce_dtype_of
from lightning_mp.master import MasterWeights, MasterWeightsOption, is_norm, masters_for
from lightning_mp.policy import CastPolicy, ModuleRules, override_context
from lightning_mp.scaler import DynamicLossScaler
from lightning_mp.settings import foreign_scaler_state
from lightning_mp.schedulers import guard_scheduler, record_step
from lightning_mp.unscaled import UnscaledGradients

PrecisionName = Literal["16-mixed", "bf16-mixed"]
_DTYPES: dict[str, torch.dtype] = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}

_WARNED_FP16_ON_CPU = False

class MixedPrecisionPlugin(Precision):
    """Mixed-precision training with a loss scaler you can tune and inspect.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast, default) or ``"bf16-mixed"`` (bf16 autocast, no scaling).
        scaler: for ``16-mixed``: ``None`` for a default :class:`~lightning_mp.DynamicLossScaler`, a
            ``DynamicLossScaler`` you configured, or a number for a static scale (never changes; non-finite
            steps are still skipped), or a mapping of ``DynamicLossScaler`` arguments (for YAML). For
            ``bf16-mixed``: ``None`` (default) checks every step's gradients for inf/NaN and skips a non-finite
            step without scaling (:meth:`DynamicLossScaler.check_only`, one host sync per step, as fp16 pays);
            ``DynamicLossScaler(enabled=False)`` or ``{"enabled": False}`` turns that check off; a
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
            bytes); names such as ``"bf16"`` work too. No effect on one device. See README "Many devices".

    The autocast device is the device the model lives on, found when Lightning connects the plugin; ``fp16``
    is honoured on CPU too (Lightning's built-in switches to bf16 there), with a one-time warning that it is
    slow. A step whose gradients hold inf/NaN is skipped, and LR schedulers with ``interval="step"`` do not
    advance on it.
    """

    def __init__(
        self,
        precision: PrecisionName = "16-mixed",
        scaler: Union[DynamicLossScaler, float, dict[str, Any], None] = None,
        master_weights: MasterWeightsOption = False,
        keep_norm_fp32: bool = True,
        policy: Union[CastPolicy, str, dict[str, Any], None] = None,
        reduce_dtype: Union[str, torch.dtype] = "float32",
    ) -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"MixedPrecisionPlugin(precision={precision!r}) is not supported: use one of {sorted(_DTYPES)}."
            )
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.scaler: Optional[DynamicLossScaler] = DynamicLossScaler.for_precision(precision, scaler)
        if not isinstance(keep_norm_fp32, bool):
            raise ValueError(f"keep_norm_fp32={keep_norm_fp32!r} must be True or False.")
        self.policy = CastPolicy.coerce(policy)
        self.reduce_dtype = reduce_dtype_of(reduce_dtype)
        # what the strategy needs at each step (lightning_mp.distributed); set up in convert_module
        self._sync: GradientSync = GradientSync()
        self.keep_norm_fp32 = keep_norm_fp32
        self.masters: Optional[MasterWeights] = masters_for(self.dtype, master_weights, self._params_stay_fp32)
        self._effective_policy = self.policy
        self._module_rules = ModuleRules()
        self._device_type: Optional[str] = None
        self._param_names: dict[int, str] = {}
        # which optimizers' gradients are unscaled since their backward (the one place that decides it)
        self._unscaled = UnscaledGradients()
        # --- extension point for diagnostics: called as observer(plugin=, optimizer=, model=) on every skipped
        # step, after the inf/NaN check and before the scaler updates (PrecisionMonitor localises the overflow)
        self.skip_observers: list[Callable[..., None]] = []

    @property
    def device_type(self) -> str:
        """The autocast device type: where the model lives once connected (before that: CUDA if present)."""
        if self._device_type is not None:
            return self._device_type
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def master_weights(self) -> bool:
        """Whether the model is held in half precision with fp32 master weights (flat copies or lean remainders)."""
        return self.masters is not None

    # ------------------------------------------------------------------ the casting policy
    def keeps_fp32(self, name: str, module: Module) -> bool:
        """Whether module ``name`` runs in fp32 (inputs upcast, autocast off) and, with master weights, keeps fp32
        parameters. Default: the policy's ``fp32_modules`` rules. Override this one method to decide per module."""
        return self._effective_policy.module_in_fp32(name, module)

    def _params_stay_fp32(self, name: str, module: Module) -> bool:
        return (self.keep_norm_fp32 and is_norm(name, module)) or self.keeps_fp32(name, module)

    def _resolve_policy(self, module: Module) -> None:
        declare = getattr(module, "configure_precision_policy", None)
        self._effective_policy = self.policy
        if callable(declare):
            declared = CastPolicy.coerce(declare())
            self._effective_policy = self.policy.merged_with(declared)
            _info_once(
                f"lightning_mp: {type(module).__name__}.configure_precision_policy() merged on top of the "
                f"plugin's policy: {self._effective_policy!r}"
            )

    @property
    def effective_policy(self) -> CastPolicy:
        """The plugin's policy merged with the LightningModule's ``configure_precision_policy()``, once connected."""
        return self._effective_policy

    @property
    def _checking(self) -> bool:
        """Whether gradients are unscaled and checked for inf/NaN each step (fp16 scaling, or bf16's check)."""
        return self.scaler is not None and self.scaler.enabled

    def fsdp2_policy(self, name: str = "", module: Optional[Module] = None) -> Any:
        """The FSDP2 ``MixedPrecisionPolicy`` matching this plugin, for ``fully_shard(..., mp_policy=...)`` in
        ``configure_model``; see :func:`lightning_mp.distributed.mixed_precision_policy`."""
        return mixed_precision_policy(self, name, module)

    # ------------------------------------------------------------------ setup
    @override
    def convert_module(self, module: Module) -> Module:
        # Runs once per fit/validate/test/predict, before the model moves to its device and before
        # configure_optimizers, so the optimizers are built on the half parameters and connect() swaps in masters.
        # The conversion is in place: DDP discards the returned module. Under FSDP2 its sharded fp32 parameters are
        # the masters, so nothing is converted (lightning_mp.distributed refuses DeepSpeed and FSDP1 here).
        self._resolve_policy(module)
        trainer = getattr(module, "_trainer", None)
        self._sync = sync_for(trainer.strategy if trainer is not None else None, self)
        if self.masters is None or self._sync.owns_masters:
            return module
        return self.masters.convert(module)

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        # Runs after the model is on its device and the optimizers exist, before checkpoint state is restored.
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        self._device_type = _module_device(inner).type
        self._param_names = {id(param): name for name, param in inner.named_parameters()}
        self._resolve_policy(inner)
        self._module_rules.install(inner, self.keeps_fp32, self._device_type)
        if self.masters is not None and not self._sync.owns_masters:
            self.masters.attach(optimizers)
            for param, master in self.masters.pairs():
                self._param_names[id(master)] = self._param_names.get(id(param), "")
        self._sync.connect(model, self)  # DDP: comm hooks, masters broadcast from rank 0; FSDP2: policy checks
        if self.scaler is not None:
            self.scaler.gather_names = self._sync.gather_names  # culprits at min_scale, from every rank
        self._unscaled.clear()
        for rule, close in self._effective_policy.unmatched_module_rules(inner).items():
            rank_zero_warn(
                f"CastPolicy fp32_modules rule {rule!r} matches no module of {type(inner).__name__}, so it does "
                f"nothing. Closest module names and classes: {close or 'none'}."
            )
        if self._device_type == "cpu" and self.dtype == torch.float16:
            _warn_fp16_on_cpu()
        for config in lr_schedulers:
            if getattr(config, "interval", "step") == "step":
                # the guard counts the optimizer steps that ran and applies the frequency itself, so Lightning
                # (which counts batches) must call it after every optimizer step
                guard_scheduler(config.scheduler, frequency=getattr(config, "frequency", 1))
                if hasattr(config, "frequency"):
                    config.frequency = 1
        return model, optimizers, lr_schedulers

    # ------------------------------------------------------------------ forward and backward
    def autocast_context_manager(self) -> torch.autocast:
        """The ``torch.autocast`` context used for every forward (train, validation, test, predict)."""
        return torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # autocast alone on the default path; the policy's op overrides add a TorchFunctionMode
        with self.autocast_context_manager(), override_context(self._effective_policy, self.device_type, self.dtype):
            yield

    @override
    def pre_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # scale before Lightning's on_before_backward hooks, as its built-in plugin does. A new backward ends
        # every "already unscaled" record: gradients still unscaled are scaled back so the sum stays consistent
        if self.masters is not None:
            self.masters.before_backward()  # lean masters: gradients of earlier micro-batches add up in fp32
        if self._checking:
            assert self.scaler is not None
            self._unscaled.new_backward(self.scaler)
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def post_backward(self, tensor: Tensor, module: LightningModule) -> Tensor:  # type: ignore[override]
        # on_after_backward hooks still see the half gradients; then they move to the fp32 masters (adding up
        # across accumulated micro-batches in fp32) and the half ones are freed
        closure_loss = super().post_backward(tensor, module)
        if self.masters is not None:
            self.masters.grads_to_masters()
        self._sync.after_backward()  # DDP with masters: reduce the fp32 master gradients once DDP would have
        return closure_loss

    # ------------------------------------------------------------------ the optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if isinstance(optimizer, LBFGS) and (self._checking or self.masters is not None):
            raise MisconfigurationException(
                "MixedPrecisionPlugin with loss scaling or master weights cannot drive LBFGS: it re-evaluates the "
                "closure inside step(), where scaled gradients cannot be checked and the half model is stale. "
                "Use precision='bf16-mixed' without master weights, or fp32."
            )
        if not self._checking:  # lean masters step themselves (fused_step): closure and Lightning's hooks first
            if hasattr(self.masters, "fused_step"):
                closure(), self._after_closure(model, optimizer)
                return self._step(optimizer, None)
            return self._step(optimizer, None, closure=partial(self._wrap_closure, model, optimizer, closure), **kwargs)
        assert self.scaler is not None
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: no backward ran, so nothing to unscale or step. Hooks and clipping
            # still run, as in Lightning; whatever they unscale stays recorded until the next backward ends it
            self._after_closure(model, optimizer)
            return None
        torch_optimizer = _unwrap_optimizer(optimizer)
        # unscale after the closure and before on_before_optimizer_step, so hooks and clipping see true grads
        found_inf = self._sync.agree(self._unscale_once(optimizer))  # every rank takes the same decision
        self._after_closure(model, optimizer)
        self._unscaled.consumed(torch_optimizer)
        skip = self.scaler.found_inf(found_inf)  # the step's one host synchronisation
        record_step(torch_optimizer, skipped=skip)
        step_output = None
        if not skip:
            step_output = self._step(optimizer, None, **kwargs)
        for observer in self.skip_observers if skip else ():  # --- the diagnostics extension point (see __init__)
            observer(plugin=self, optimizer=torch_optimizer, model=model)
        self.scaler.update(skip)
        return step_output

    def _step(self, optimizer: Optimizable, found_inf: Optional[Tensor], **kwargs: Any) -> Any:  # masters' or not
        torch_optimizer = _unwrap_optimizer(optimizer)
        if hasattr(self.masters, "fused_step"):
            return self.masters.fused_step(torch_optimizer, found_inf)  # type: ignore[union-attr]
        step_output = optimizer.step(**kwargs)
        if self.masters is not None:
            self.masters.masters_to_model(torch_optimizer)
        return step_output

    def _unscale_once(self, optimizer: Optimizable) -> Tensor:
        """Unscale ``optimizer``'s grads unless already done since their backward; the found-inf flag tensor."""
        optimizer = _unwrap_optimizer(optimizer)
        named = [
            (self._param_names.get(id(param), f"param_groups[{g}][{i}]"), param)
            for g, group in enumerate(optimizer.param_groups)
            for i, param in enumerate(group["params"])
        ]
        assert self.scaler is not None
        return self._unscaled.unscale(self.scaler, optimizer, named)

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: Union[int, float] = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # In manual optimization `self.clip_gradients` runs inside training_step, before `opt.step()`:
        # unscale here so clipping sees true gradients; optimizer_step then does not unscale twice.
        # Fused optimizers need no special case: we always unscale before calling their step().
        if clip_val > 0 and self._checking and _has_grads(optimizer):
            self._unscale_once(optimizer)
        super().clip_gradients(optimizer, clip_val=clip_val, gradient_clip_algorithm=gradient_clip_algorithm)

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        # no gradients (a training_step that returned None): nothing to clip, and torch's value clipping fails there.
        # Lean masters clip the fp32 gradients inside their step (bf16 gradients would round the clipped values)
        if _has_grads(optimizer):
            lean = getattr(self.masters, "clip_grad_value_", None)
            lean(_unwrap_optimizer(optimizer), clip_val) if lean else super().clip_grad_by_value(optimizer, clip_val)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        lean = getattr(self.masters, "clip_grad_norm_", None)
        lean(_unwrap_optimizer(optimizer), clip_val) if lean else super().clip_grad_by_norm(optimizer, clip_val)

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
        if self.masters is not None:
            self.masters.restore()
        self._module_rules.remove()
        super().teardown()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(precision={self.precision!r}, scaler={self.scaler!r}, "
            f"master_weights={self.master_weights}, policy={self.policy!r})"
        )


_INFO_SHOWN: set[str] = set()


def _info_once(message: str) -> None:
    if message not in _INFO_SHOWN:
        _INFO_SHOWN.add(message)
        rank_zero_info(message)


def _has_grads(optimizer: Any) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def _unwrap_optimizer(optimizer: Any) -> Any:
    # LightningOptimizer (what the user holds in manual optimization) wraps the torch optimizer
    return getattr(optimizer, "_optimizer", optimizer)


def _module_device(module: Module) -> torch.device:
    return next((t.device for t in (*module.parameters(), *module.buffers())), getattr(module, "device", None)) or (
        torch.device("cpu"))


def _warn_fp16_on_cpu() -> None:
    global _WARNED_FP16_ON_CPU
    if not _WARNED_FP16_ON_CPU:
        _WARNED_FP16_ON_CPU = True
        rank_zero_warn(
            "MixedPrecisionPlugin(precision='16-mixed') runs real fp16 autocast on CPU. CPUs have no fast fp16 "
            "matmul kernels: expect it to be many times slower than fp32. On CPUs with native bf16 (AVX512-BF16 "
            "or AMX), precision='bf16-mixed' is the fast choice; on others, fp32 is (see benchmarks/RESULTS.md)."
        )
