"""``CastPolicy``: which ops run in half precision and which in fp32, as plain data (presets, rules, describe).

What applies it during forward (autocast, a ``TorchFunctionMode`` for the overridden ops, hooks that run whole
modules in fp32) is :mod:`lightning_mp.forward`; which ``nn.Linear`` layers train in fp8 is
:mod:`lightning_mp.fp8.layers` (through :meth:`CastPolicy.fp8_layers`).
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

_T = torch.Tensor
#: User-facing op names -> the torch functions that implement them (functional, torch.*, Tensor methods).
OPS: dict[str, tuple[Callable[..., Any], ...]] = {
    "linear": (F.linear,),
    "matmul": (torch.matmul, _T.matmul, _T.__matmul__),
    "mm": (torch.mm, _T.mm),
    "bmm": (torch.bmm, _T.bmm),
    "addmm": (torch.addmm, _T.addmm),
    "baddbmm": (torch.baddbmm, _T.baddbmm),
    "conv1d": (F.conv1d,),
    "conv2d": (F.conv2d,),
    "conv3d": (F.conv3d,),
    "scaled_dot_product_attention": (F.scaled_dot_product_attention,),
    "softmax": (F.softmax, torch.softmax, _T.softmax),
    "log_softmax": (F.log_softmax, torch.log_softmax, _T.log_softmax),
    "layer_norm": (F.layer_norm,),
    "group_norm": (F.group_norm,),
    "batch_norm": (F.batch_norm,),
    "rms_norm": (F.rms_norm,),
    "exp": (torch.exp, _T.exp),
    "pow": (torch.pow, _T.pow, _T.__pow__),
    "sum": (torch.sum, _T.sum),
    "mean": (torch.mean, _T.mean),
    "norm": (torch.norm, _T.norm, torch.linalg.vector_norm),
    "cumsum": (torch.cumsum, _T.cumsum),
    "cross_entropy": (F.cross_entropy,),
    "nll_loss": (F.nll_loss,),
    "mse_loss": (F.mse_loss,),
    "l1_loss": (F.l1_loss,),
    "smooth_l1_loss": (F.smooth_l1_loss,),
    "binary_cross_entropy": (F.binary_cross_entropy,),
    "binary_cross_entropy_with_logits": (F.binary_cross_entropy_with_logits,),
    "kl_div": (F.kl_div,),
}
_MATMULS = (
    "linear",
    "matmul",
    "mm",
    "bmm",
    "addmm",
    "baddbmm",
    "conv1d",
    "conv2d",
    "conv3d",
    "scaled_dot_product_attention",
)
_LOSSES = (
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "kl_div",
)
# What torch.autocast does with each op (measured, torch 2.13): "half" (inputs cast down), "fp32" (inputs cast
# up), or "input" (runs in its inputs' dtype, which is half after a matmul). CPU autocast leaves the
# softmax/norm/reduction group to its inputs, so it runs in half there, where CUDA autocast runs it in fp32.
_CPU_HALF_CUDA_FP32 = ("softmax", "log_softmax", "layer_norm", "group_norm", "exp", "sum", "norm", "cumsum", "pow")
AUTOCAST_DEFAULTS: dict[str, dict[str, str]] = {
    "cuda": {
        **{op: "half" for op in _MATMULS},
        **{op: "fp32" for op in (*_CPU_HALF_CUDA_FP32, *_LOSSES, "rms_norm")},
        **{op: "input" for op in ("batch_norm", "mean")},
    },
    "cpu": {
        **{op: "half" for op in _MATMULS},
        **{op: "fp32" for op in _LOSSES},
        **{op: "input" for op in (*_CPU_HALF_CUDA_FP32, "batch_norm", "mean", "rms_norm")},
    },
}
PRESETS: dict[str, dict[str, tuple[str, ...]]] = {
    # exactly torch.autocast on the device, no overrides
    "autocast": {},
    # what CUDA autocast keeps in fp32 stays fp32 on every device: a CPU run reproduces GPU numerics
    "conservative": {"fp32_ops": (*_CPU_HALF_CUDA_FP32, *_LOSSES)},
    # for a half model with master weights: norms and softmax in half (torch's kernels accumulate in fp32);
    # losses and large reductions stay fp32
    "fast": {
        "low_precision_ops": ("softmax", "layer_norm", "group_norm", "rms_norm"),
        "fp32_ops": ("log_softmax", "sum", "norm", "cumsum", *_LOSSES),
    },
}


@dataclass(frozen=True)
class CastPolicy:
    """Which ops run in half precision and which in fp32, on top of a named preset.

    Args:
        preset: ``"autocast"`` (default: torch.autocast's own choices), ``"conservative"`` or ``"fast"``.
        low_precision_ops: op names (see ``OPS``) to run in fp16/bf16: inputs cast down, autocast off.
        fp32_ops: op names to run in fp32: inputs cast up, autocast off.
        fp32_modules: module class names (``"LayerNorm"``) or qualified-name globs (``"classifier"``,
            ``"encoder.layer.*.attention"``): the whole module runs in fp32 with its inputs upcast, and with
            master weights its parameters stay fp32. Never fp8.
        fp8_exclude: with ``MixedPrecisionPlugin(fp8=...)``: rules (class names or qualified-name globs, as
            ``fp32_modules``) for modules whose ``nn.Linear`` layers stay out of fp8 (a rule on a parent, such as
            ``"LlamaAttention"`` or ``"layers.0"``, covers the layers inside it).
        fp8_only: with ``fp8``: when not empty, only the ``nn.Linear`` layers these rules match (or lie inside)
            are fp8. The default (empty) is every eligible layer: see :meth:`fp8_layers`.
    """

    preset: str = "autocast"
    low_precision_ops: tuple[str, ...] = ()
    fp32_ops: tuple[str, ...] = ()
    fp32_modules: tuple[str, ...] = ()
    fp8_exclude: tuple[str, ...] = ()
    fp8_only: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is not a CastPolicy preset: use one of {sorted(PRESETS)}.")
        for name in ("low_precision_ops", "fp32_ops", *_MODULE_RULE_FIELDS):
            value = getattr(self, name)
            if isinstance(value, str) or not isinstance(value, Iterable):
                raise ValueError(f"{name}={value!r} must be a list of names.")
            object.__setattr__(self, name, tuple(value))
        for op in (*self.low_precision_ops, *self.fp32_ops):
            if op not in OPS:
                close = difflib.get_close_matches(str(op), OPS, n=3)
                hint = f" Did you mean {close}?" if close else ""
                raise ValueError(f"unknown op {op!r} in CastPolicy.{hint} Known ops: {sorted(OPS)}.")
        for name in _MODULE_RULE_FIELDS:
            bad = [rule for rule in getattr(self, name) if not isinstance(rule, str) or not rule]
            if bad:
                raise ValueError(
                    f"{name}={list(getattr(self, name))!r} holds {bad!r}: each rule must be a non-empty string, a "
                    "module class name ('LayerNorm') or a qualified-name glob ('classifier', "
                    "'encoder.layer.*.attention')."
                )
        both = sorted(set(self.low_precision_ops) & set(self.fp32_ops))
        if both:
            raise ValueError(f"ops {both} are in both low_precision_ops and fp32_ops: each op gets one rule.")

    @classmethod
    def coerce(cls, policy: Union[CastPolicy, str, Mapping[str, Any], None]) -> CastPolicy:
        """A ``CastPolicy`` from a policy, a preset name, a mapping (YAML), or ``None`` (the default)."""
        if policy is None:
            return cls()
        if isinstance(policy, CastPolicy):
            return policy
        if isinstance(policy, str):
            return cls(preset=policy)
        if isinstance(policy, Mapping):
            unknown = sorted(set(policy) - {"preset", "low_precision_ops", "fp32_ops", *_MODULE_RULE_FIELDS})
            if unknown:
                raise ValueError(
                    f"policy keys {unknown} are not CastPolicy fields: use preset, low_precision_ops, fp32_ops, "
                    "fp32_modules, fp8_exclude, fp8_only."
                )
            return cls(**dict(policy))
        raise ValueError(
            f"policy={policy!r} is not supported: pass a CastPolicy, a preset name {sorted(PRESETS)}, or a mapping."
        )

    # ------------------------------------------------------------------ decisions
    def op_rules(self) -> dict[str, tuple[str, str]]:
        """Op name -> (``"half"`` or ``"fp32"``, where it comes from: ``preset <name>`` or ``user``) for every
        op the policy overrides; ops not listed follow torch.autocast."""
        rules: dict[str, tuple[str, str]] = {}
        preset = PRESETS[self.preset]
        for op in preset.get("low_precision_ops", ()):
            rules[op] = ("half", f"preset {self.preset}")
        for op in preset.get("fp32_ops", ()):
            rules[op] = ("fp32", f"preset {self.preset}")
        for op in self.low_precision_ops:
            rules[op] = ("half", "user")
        for op in self.fp32_ops:
            rules[op] = ("fp32", "user")
        return rules

    @staticmethod
    def rule_matches(rule: str, qualified_name: str, module: nn.Module) -> bool:
        """Whether a module rule (``fp32_modules``, ``fp8_exclude``, ``fp8_only``) matches ``module``:
        :func:`rule_matches`."""
        return rule_matches(rule, qualified_name, module)

    def module_in_fp32(self, qualified_name: str, module: nn.Module) -> bool:
        """Whether a ``fp32_modules`` rule (class name or qualified-name glob) matches this module."""
        return any(rule_matches(rule, qualified_name, module) for rule in self.fp32_modules)

    def unmatched_module_rules(self, model: nn.Module, field: str = "fp32_modules") -> dict[str, list[str]]:
        """Rules of ``field`` (``fp32_modules``, ``fp8_exclude`` or ``fp8_only``) that match no module of ``model``
        -> the closest module names and class names."""
        modules = list(model.named_modules())
        candidates = list(dict.fromkeys([n for n, _ in modules if n] + [type(m).__name__ for _, m in modules]))
        unmatched: dict[str, list[str]] = {}
        for rule in getattr(self, field):
            if not any(rule_matches(rule, n, m) for n, m in modules):
                unmatched[rule] = difflib.get_close_matches(rule, candidates, n=3, cutoff=0.4)
        return unmatched

    def merged_with(self, other: CastPolicy) -> CastPolicy:
        """This policy with ``other``'s rules on top (``other`` wins where they disagree)."""
        preset = other.preset if other.preset != "autocast" else self.preset
        low = [op for op in self.low_precision_ops if op not in other.fp32_ops] + list(other.low_precision_ops)
        fp32 = [op for op in self.fp32_ops if op not in other.low_precision_ops] + list(other.fp32_ops)
        modules = list(dict.fromkeys([*self.fp32_modules, *other.fp32_modules]))
        return replace(
            self,
            preset=preset,
            low_precision_ops=tuple(dict.fromkeys(low)),
            fp32_ops=tuple(dict.fromkeys(fp32)),
            fp32_modules=tuple(modules),
            fp8_exclude=tuple(dict.fromkeys([*self.fp8_exclude, *other.fp8_exclude])),
            fp8_only=other.fp8_only or self.fp8_only,
        )

    def for_device(self, device: str) -> CastPolicy:
        """This policy, printed (``str``, :meth:`describe`) for ``device`` (``"cpu"``, ``"cuda"``) by default."""
        policy = replace(self)
        object.__setattr__(policy, "_device", device)  # not a field: equality, repr and YAML are unchanged
        return policy

    def fp8_layers(
        self, model: nn.Module, in_fp32: Optional[Callable[[str, nn.Module], bool]] = None
    ) -> list[tuple[str, nn.Linear, str]]:
        """``(name, layer, reason)`` for every ``nn.Linear`` of ``model``, in model order; ``reason`` is ``""`` for
        a layer to convert to fp8, else why it stays out. In order of precedence: a module run in fp32
        (``in_fp32(name, module)``, default :meth:`module_in_fp32`, on the layer or a parent), an ``fp8_exclude``
        rule, not named by a non-empty ``fp8_only``, a subclass of ``nn.Linear`` (its forward may bypass the
        layer's), dimensions that are not multiples of 16 (torchao's fp8 matmuls need them), and the model's
        output projection (its last ``nn.Linear``; logits are sensitive to rounding), unless ``fp8_only`` names it.
        """
        from lightning_mp.fp8.layers import fp8_layers  # the fp8 part decides; imported only when asked

        return fp8_layers(self, model, in_fp32 or self.module_in_fp32)

    def describe(self, device: Optional[str] = None, modules: Optional[nn.Module] = None) -> str:
        """A table of the effective decision for every known op on ``device`` and where it comes from, then the
        module rules (with the modules of ``modules`` they match, when given). ``device`` defaults to the run's
        device for :attr:`MixedPrecisionPlugin.effective_policy`, else CUDA when available, else CPU."""
        device = device or getattr(self, "_device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
        defaults = AUTOCAST_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
        rules = self.op_rules()
        lines = [f"CastPolicy(preset={self.preset!r}) on {device}", f"{'op':34} {'runs in':8} from", "-" * 60]
        for op in OPS:
            decision, source = rules.get(op, (defaults.get(op, "input"), f"autocast default ({device})"))
            lines.append(f"{op:34} {decision:8} {source}")
        for rule in self.fp32_modules:
            matched = ""
            if modules is not None:
                names = [n or "<root>" for n, m in modules.named_modules() if rule_matches(rule, n, m)]
                matched = f" -> {len(names)} modules: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
            lines.append(f"module {rule!r:27} fp32     user{matched}")
        lines += [f"module {rule!r:27} not fp8  user (fp8_exclude)" for rule in self.fp8_exclude]
        lines += [f"module {rule!r:27} fp8 only user (fp8_only)" for rule in self.fp8_only]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


# ---------------------------------------------------------------------- module rules
_MODULE_RULE_FIELDS = ("fp32_modules", "fp8_exclude", "fp8_only")


def rule_matches(rule: str, qualified_name: str, module: nn.Module) -> bool:
    """An ``fp32_modules`` rule matches a module by its class name or by a glob over its qualified name."""
    return type(module).__name__ == rule or fnmatch.fnmatchcase(qualified_name, rule)
