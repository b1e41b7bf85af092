"""Which ``nn.Linear`` layers train in fp8, converting them with torchao, and the table that says why.

:class:`Fp8Training` is the plugin's fp8 part. At setup (``convert_module``; under FSDP2 ``plugin.fsdp2_shard(self)``
or ``plugin.fp8_convert(self)`` in ``configure_model``, before ``fully_shard``) it asks the cast policy which layers
are eligible (:meth:`lightning_mp.CastPolicy.fp8_layers`), swaps them for torchao's ``Float8Linear`` in place
(parameters keep their identity, so master weights and optimizers are unaffected), logs a table of every
``nn.Linear`` with its reason, and warns, naming fp8, when no layer is eligible. Under FSDP2 with fp8 all-gather it
precomputes the fp8 weight scales after every optimizer step (one all-reduce for all layers), as torchao asks.

``Float8Linear`` keeps plain ``weight``/``bias`` parameters, so a converted model's ``state_dict`` has the same keys
and plain tensors as the unconverted one and loads strictly into it. fp8 casts are taken from the weights the
model computes with: bf16 with ``master_weights`` (the masters stay exact), fp32 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_mp.fp8.config import Fp8Spec, fp8_mode, import_float8, linear_config, recipe_of, validate_fp8
from lightning_mp.fp8.layers import Fp8Rules


class PolicySource(Protocol):
    """What :meth:`Fp8Training.convert` reads of :class:`~lightning_mp.MixedPrecisionPlugin` (which imports this
    module, so it is named by what it offers): the cast policy in effect and which modules it keeps in fp32."""

    @property
    def effective_policy(self) -> Fp8Rules: ...

    def keeps_fp32(self, name: str, module: nn.Module) -> bool: ...


@dataclass(frozen=True)
class Fp8Layer:
    """One ``nn.Linear`` of the model: its qualified ``name``, ``in_features`` x ``out_features``, whether it trains
    in fp8 (``converted``) and, when not, ``reason``."""

    name: str
    in_features: int
    out_features: int
    converted: bool
    reason: str = ""


class Fp8Training:
    """The fp8 part of :class:`~lightning_mp.MixedPrecisionPlugin` (``fp8=`` a recipe name or a torchao
    ``Float8LinearConfig``; see :mod:`lightning_mp.fp8.config`).

    Attributes:
        spec: what the user passed (validated).
        config: the ``Float8LinearConfig`` the layers were converted with (``None`` before setup).
        layers: one :class:`Fp8Layer` per ``nn.Linear`` of the model, in model order (after setup).
        mode: ``"real"`` or ``"emulated"`` (after setup).
    """

    def __init__(self, fp8: Fp8Spec, precision: str) -> None:
        self.spec = validate_fp8(fp8, precision)
        self.recipe = recipe_of(self.spec)
        self.config: Any = None
        self.layers: list[Fp8Layer] = []
        self.mode = ""
        self.notes: list[str] = []
        self._hooks: list[Any] = []

    @classmethod
    def create(cls, fp8: Fp8Spec, precision: str) -> Optional[Fp8Training]:
        """``None`` when ``fp8`` is ``None`` (torchao is then never imported), else a validated instance."""
        return None if fp8 is None else cls(fp8, precision)

    @property
    def converted(self) -> list[str]:
        """Names of the layers that train in fp8."""
        return [layer.name for layer in self.layers if layer.converted]

    # ------------------------------------------------------------------ setup
    def convert(self, module: nn.Module, plugin: PolicySource, strategy: Any = None) -> nn.Module:
        """Convert the eligible layers of ``module`` in place (layers converted before stay so), log the table.

        Raises:
            ValueError: under FSDP2, eligible layers already sharded by ``fully_shard`` without being converted.
            RuntimeError: a CUDA device without fp8 support (see :func:`~lightning_mp.fp8.config.fp8_mode`).
        """
        float8 = import_float8()
        device = _device_of(module, strategy)
        fsdp2 = type(strategy).__name__ == "ModelParallelStrategy"
        self.config, self.notes = linear_config(self.spec, device, fsdp2=fsdp2)
        self.mode = "emulated" if self.config.emulate else fp8_mode(device)
        layers, chosen = [], set()
        for name, layer, reason in plugin.effective_policy.fp8_layers(module, plugin.keeps_fp32):
            done = isinstance(layer, float8.float8_linear.Float8Linear)
            if not reason and not done:
                chosen.add(name)
            layers.append(
                Fp8Layer(name, layer.in_features, layer.out_features, done or not reason, "" if done else reason)
            )
        if chosen and fsdp2:
            _refuse_sharded(module, chosen)
        if chosen:
            float8.convert_to_float8_training(module, config=self.config, module_filter_fn=lambda _, fqn: fqn in chosen)
            # Float8Linear follows CUDA's autocast only, and leaves it on around its matmul, where autocast's cast of
            # an fp8 operand fails in evaluation (seen on an H100, trainer.test: aten.to.dtype on a
            # Float8TrainingTensor): on every device, the input cast it does and autocast off inside the layer
            for name in chosen:
                _follow_autocast(module.get_submodule(name), device.type)
        if not chosen and layers == self.layers:  # e.g. convert_module after fp8_convert: the table was shown
            return module
        self.layers = layers
        for rule, close in _unmatched_fp8_rules(plugin.effective_policy, module).items():
            rank_zero_warn(
                f"CastPolicy {rule} matches no module of {type(module).__name__}, so it does nothing. "
                f"Closest module names and classes: {close or 'none'}."
            )
        rank_zero_info(self.table(type(module).__name__))
        if not self.converted:
            reasons = sorted({layer.reason for layer in layers})
            rank_zero_warn(
                f"MixedPrecisionPlugin(fp8={self.recipe!r}): no nn.Linear layer of {type(module).__name__} is "
                f"eligible for fp8 ({len(layers)} nn.Linear layers; reasons: {reasons or ['the model has none']}), "
                "so fp8 changes nothing and the model trains in bf16 autocast. torchao converts plain nn.Linear "
                "layers whose in/out features are multiples of 16 (HF GPT-2's Conv1D is not nn.Linear); check the "
                "policy's fp8_exclude / fp8_only / fp32_modules rules, or use fp8=None."
            )
        return module

    def table(self, model_name: str = "the model") -> str:
        """The setup table: the recipe, where it runs, and every ``nn.Linear`` with its decision and reason."""
        converted = [layer for layer in self.layers if layer.converted]
        weights = sum(layer.in_features * layer.out_features for layer in self.layers) or 1
        share = sum(layer.in_features * layer.out_features for layer in converted) / weights
        lines = [
            f"lightning_mp fp8 ({self.recipe}, {self.mode}): {len(converted)} of {len(self.layers)} nn.Linear "
            f"layers of {model_name} train in fp8 ({share:.1%} of their weights)",
            *self.notes,
        ]
        width = max([len(layer.name) for layer in self.layers] + [5])
        lines.append(f"{'layer':{width}}  {'in x out':>13}  fp8  reason")
        for layer in self.layers:
            shape = f"{layer.in_features} x {layer.out_features}"
            decision = f"{layer.name:{width}}  {shape:>13}  {'yes' if layer.converted else 'no ':3}  {layer.reason}"
            lines.append(decision.rstrip())
        return "\n".join(lines)

    def connect(self, model: nn.Module, optimizers: list[Any]) -> None:
        """Under FSDP2 with fp8 all-gather: precompute the fp8 weight scales after every optimizer step that ran
        (a skipped step changes no weight, so the scales stay right)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.config is None or not self.config.enable_fsdp_float8_all_gather or not self.converted:
            return
        precompute = import_float8().precompute_float8_dynamic_scale_for_fsdp
        for optimizer in optimizers:
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: precompute(model)))


def _follow_autocast(layer: nn.Module, device_type: str) -> None:
    """What ``Float8Linear`` does under CUDA autocast, for any device: its input cast to the autocast dtype (where
    ``Float8Linear`` then finds autocast off and casts nothing more), and autocast off inside it (its matmul operands
    are fp8 already: casting them is what fails under inference mode, ``aten.to.dtype`` on a
    ``Float8TrainingTensor``, on the CPU and, in evaluation, on CUDA). A plain switch, as in the policy's module
    rules, so that ``torch.compile`` traces it."""
    previous: list[bool] = []

    def pre_hook(module: nn.Module, args: tuple[Any, ...]) -> Any:
        enabled = torch.is_autocast_enabled(device_type)
        previous.append(enabled)
        if not enabled:
            return None
        torch.set_autocast_enabled(device_type, False)
        dtype = torch.get_autocast_dtype(device_type)
        if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() and args[0].dtype != dtype:
            return (args[0].to(dtype), *args[1:])
        return None

    def post_hook(module: nn.Module, args: Any, output: Any) -> Any:
        torch.set_autocast_enabled(device_type, previous.pop())
        return output

    layer.register_forward_pre_hook(pre_hook)
    layer.register_forward_hook(post_hook, always_call=True)


def _device_of(module: nn.Module, strategy: Any) -> torch.device:
    root = getattr(strategy, "root_device", None)
    if root is not None:
        return torch.device(root)
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


def _refuse_sharded(module: nn.Module, chosen: set[str]) -> None:
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(sub, FSDPModule) for sub in module.modules()):
        shown = ", ".join(sorted(chosen)[:5]) + (" ..." if len(chosen) > 5 else "")
        raise ValueError(
            f"MixedPrecisionPlugin(fp8=...) under FSDP2: layers {shown} were sharded with fully_shard before being "
            "converted to fp8, and FSDP2 keeps the modules it sharded. Convert first: in configure_model call "
            "self.trainer.precision_plugin.fp8_convert(self) before fully_shard(...), or shard with "
            "self.trainer.precision_plugin.fsdp2_shard(self, blocks=..., root=...), which converts first."
        )


def _unmatched_fp8_rules(policy: Fp8Rules, module: nn.Module) -> dict[str, list[str]]:
    found = {}
    for field in ("fp8_exclude", "fp8_only"):
        for rule, close in policy.unmatched_module_rules(module, field).items():
            found[f"{field} rule {rule!r}"] = close
    return found
