"""What runs around every forward: ``torch.autocast`` on the model's device, and the cast policy applied there.

The default path is ``torch.autocast`` alone. A policy with op overrides adds a ``TorchFunctionMode`` that handles
only the overridden torch functions (inputs cast, autocast off for that call) and passes everything else through;
``fp32_modules`` rules add forward hooks that run whole modules in fp32 (:class:`ModuleRules`). The policy itself,
as data, is :mod:`lightning_mp.policy`. Also here: the model's device (the autocast device) and the one-time warning
for fp16 on CPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, Callable

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.nn import Module
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from lightning_mp.cpu import warn_bf16_without_native_instructions
from lightning_mp.policy import OPS, CastPolicy

_WARNED_FP16_ON_CPU = False
_INFO_SHOWN: set[str] = set()


def module_policy(policy: CastPolicy, module: Module) -> CastPolicy:
    """``policy`` with ``module``'s own ``configure_precision_policy()``, if it declares one, merged on top (the
    module wins); said once per distinct result."""
    declare = getattr(module, "configure_precision_policy", None)
    if not callable(declare):
        return policy
    merged = policy.merged_with(CastPolicy.coerce(declare()))
    message = (
        f"lightning_mp: {type(module).__name__}.configure_precision_policy() merged on top of the plugin's policy: "
        f"{merged!r}"
    )
    if message not in _INFO_SHOWN:
        _INFO_SHOWN.add(message)
        rank_zero_info(message)
    return merged


def warn_at_connect(policy: CastPolicy, model: Module, device_type: str, dtype: torch.dtype) -> None:
    """What is worth a warning once the model is on its device: ``fp32_modules`` rules that match no module of
    ``model`` (with the closest names), fp16 autocast on CPU, and bf16 on a CPU without bf16 instructions."""
    for rule, close in policy.unmatched_module_rules(model).items():
        rank_zero_warn(
            f"CastPolicy fp32_modules rule {rule!r} matches no module of {type(model).__name__}, so it does "
            f"nothing. Closest module names and classes: {close or 'none'}."
        )
    if device_type == "cpu" and dtype == torch.float16:
        warn_fp16_on_cpu()
    if device_type == "cpu" and dtype == torch.bfloat16:
        warn_bf16_without_native_instructions()  # this CPU has no bf16 instructions: fp32 is the fast choice here


def module_device(module: Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for buffer in module.buffers():
        return buffer.device
    return getattr(module, "device", torch.device("cpu"))


def warn_fp16_on_cpu() -> None:
    global _WARNED_FP16_ON_CPU
    if not _WARNED_FP16_ON_CPU:
        _WARNED_FP16_ON_CPU = True
        rank_zero_warn(
            "MixedPrecisionPlugin(precision='16-mixed') runs real fp16 autocast on CPU. CPUs have no fast fp16 "
            "matmul kernels: expect it to be many times slower than fp32. Some ops have no fp16 CPU kernel at all "
            "(nn.LSTM among them) and stop the first forward with an error naming the module and the cast-policy "
            "line that runs it in fp32 (policy={'fp32_modules': ['LSTM']}). On CPUs with native bf16 (AVX512-BF16 "
            "or AMX: lscpu lists avx512_bf16 or amx_bf16), precision='bf16-mixed' is the fast choice; on others, "
            "fp32 is."
        )


class _OverrideMode(TorchFunctionMode):
    """Intercepts only the overridden torch functions; everything else passes through untouched."""

    def __init__(self, targets: dict[Callable[..., Any], torch.dtype], device_type: str) -> None:
        super().__init__()
        self.targets = targets
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.targets.get(func)
        if dtype is None:
            return func(*args, **kwargs)
        cast = _caster(dtype)
        with torch.autocast(self.device_type, enabled=False):
            return func(*tree_map(cast, args), **tree_map(cast, kwargs))


def _caster(dtype: torch.dtype) -> Callable[[Any], Any]:
    def cast(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point() and value.dtype != dtype:
            return value.to(dtype)
        return value

    return cast


@contextlib.contextmanager
def override_context(policy: CastPolicy, device_type: str, half_dtype: torch.dtype) -> Iterator[None]:
    """The op overrides of ``policy`` (nothing at all when it has none: autocast alone)."""
    targets = override_targets(policy, half_dtype)
    if not targets:
        yield
        return
    with _OverrideMode(targets, device_type):
        yield


@functools.lru_cache(maxsize=64)
def override_targets(policy: CastPolicy, half_dtype: torch.dtype) -> dict[Callable[..., Any], torch.dtype]:
    # computed once per (frozen) policy and dtype, not on every forward
    return {
        func: (half_dtype if decision == "half" else torch.float32)
        for op, (decision, _) in policy.op_rules().items()
        for func in OPS[op]
    }


class ModuleRules:
    """Forward hooks that run the matching modules in fp32: inputs upcast, autocast off inside."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def install(self, model: nn.Module, in_fp32: Callable[[str, nn.Module], bool], device_type: str) -> list[str]:
        """Hook every module for which ``in_fp32(name, module)`` is true (outermost only); returns their names."""
        self.remove()
        chosen: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(parent + ".") or parent == "" for parent in chosen) or not in_fp32(name, module):
                continue
            chosen.append(name)
            previous: list[bool] = []
            upcast = _caster(torch.float32)

            def pre_hook(
                mod: nn.Module, args: Any, kwargs: Any, previous: list[bool] = previous, upcast: Any = upcast
            ) -> Any:
                # a plain switch rather than an autocast object entered here and left in post_hook: the
                # object form breaks under torch.compile, the switch does not
                previous.append(torch.is_autocast_enabled(device_type))
                torch.set_autocast_enabled(device_type, False)
                return tree_map(upcast, args), tree_map(upcast, kwargs)

            def post_hook(mod: nn.Module, args: Any, kwargs: Any, output: Any, previous: list[bool] = previous) -> Any:
                torch.set_autocast_enabled(device_type, previous.pop())
                return output

            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            self._handles.append(module.register_forward_hook(post_hook, with_kwargs=True, always_call=True))
        return chosen

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
