"""Which ``nn.Linear`` layers of a model train in fp8, and why the others do not: the cast policy's fp8 rules
(``fp8_exclude``, ``fp8_only``), its fp32 modules, and what torchao's fp8 matmuls need.

:meth:`lightning_mp.CastPolicy.fp8_layers` is the public door; :class:`~lightning_mp.fp8.convert.Fp8Training`
converts what :func:`fp8_layers` chose. Nothing here imports torchao.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

from torch import nn


class Fp8Rules(Protocol):
    """What the fp8 part reads of a cast policy (:class:`~lightning_mp.CastPolicy`, which asks this module for its
    :meth:`~lightning_mp.CastPolicy.fp8_layers`, so that the fp8 part names it by what it offers and never imports
    it): its fp8 rules, how a rule matches a module, the layers it allows and the rules that match nothing."""

    @property
    def fp8_exclude(self) -> tuple[str, ...]: ...

    @property
    def fp8_only(self) -> tuple[str, ...]: ...

    def rule_matches(self, rule: str, qualified_name: str, module: nn.Module) -> bool: ...

    def fp8_layers(
        self, model: nn.Module, in_fp32: Optional[Callable[[str, nn.Module], bool]] = None
    ) -> list[tuple[str, nn.Linear, str]]: ...

    def unmatched_module_rules(self, model: nn.Module, field: str = "fp32_modules") -> dict[str, list[str]]: ...


def fp8_layers(
    policy: Fp8Rules, model: nn.Module, in_fp32: Callable[[str, nn.Module], bool]
) -> list[tuple[str, nn.Linear, str]]:
    """``(name, layer, reason)`` for every ``nn.Linear`` of ``model``, in model order (see
    :meth:`lightning_mp.CastPolicy.fp8_layers` for the reasons and their precedence)."""
    modules = dict(model.named_modules())
    linears = [(name, module) for name, module in modules.items() if isinstance(module, nn.Linear)]
    chosen: list[tuple[str, nn.Linear, str]] = []
    for index, (name, module) in enumerate(linears):
        chain = [(parent, modules[parent]) for parent in _ancestors(name) if parent in modules]
        fp32 = next((n for n, m in chain if in_fp32(n, m)), None)
        excluded = next((r for r in policy.fp8_exclude for n, m in chain if policy.rule_matches(r, n, m)), None)
        named = not policy.fp8_only or any(policy.rule_matches(r, n, m) for r in policy.fp8_only for n, m in chain)
        dims = (module.in_features, module.out_features)
        cls = type(module)  # fully_shard makes an nn.Linear an FSDPLinear(FSDPModule, nn.Linear): still plain
        reason = (
            f"runs in fp32 ({fp32 or '(root)'} is an fp32 module)"
            if fp32 is not None
            else f"fp8_exclude rule {excluded!r}"
            if excluded is not None
            else "not named by fp8_only"
            if not named
            else f"{type(module).__name__} is a subclass of nn.Linear"
            if cls is not nn.Linear and (cls.__name__, cls.__bases__[1:]) != ("FSDPLinear", (nn.Linear,))
            else f"in/out features {dims} are not multiples of 16"
            if any(d % 16 for d in dims)
            else "the model's output projection (name it in fp8_only to convert it)"
            if index == len(linears) - 1 and not policy.fp8_only
            else ""
        )
        chosen.append((name, module, reason))
    return chosen


def _ancestors(name: str) -> list[str]:
    """``["a.b.c", "a.b", "a", ""]`` for ``"a.b.c"``: the module and every parent up to the root."""
    parts = name.split(".") if name else []
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]
