"""What the plugin needs to know about the device a model runs on: which one it is, and what it does badly."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.nn import Module

_WARNED_FP16_ON_CPU = False


def module_device(module: Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return getattr(module, "device", torch.device("cpu"))


def warn_fp16_on_cpu() -> None:
    global _WARNED_FP16_ON_CPU
    if not _WARNED_FP16_ON_CPU:
        _WARNED_FP16_ON_CPU = True
        rank_zero_warn(
            "MixedPrecisionPlugin(precision='16-mixed') runs real fp16 autocast on CPU. CPUs have no fast fp16 "
            "matmul kernels: expect it to be many times slower than fp32. On CPUs with native bf16 (AVX512-BF16 "
            "or AMX), precision='bf16-mixed' is the fast choice; on others, fp32 is (see benchmarks/RESULTS.md)."
        )


def local_shard(grad: Tensor) -> Tensor:
    """A ``DTensor`` gradient's local shard (same storage, so unscaling it in place unscales the DTensor)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad
