"""What this CPU can do in half precision: whether its bf16 matmul is native, and the warning that says so.

bf16 matmuls are fast on a CPU only with bf16 instructions: AVX512-BF16 or AMX-BF16 on x86 (``lscpu`` lists
``avx512_bf16`` / ``amx_bf16``), the BF16 extension on Arm (``bf16``). Elsewhere torch runs them on a fallback kernel:
measured on AVX2-only EPYCs at 0.2-0.45 GFLOP/s against fp32's 17-71 (a bf16 training step is then its matmuls, 10 to
30 times fp32's; ``benchmarks/RESULTS.md``), while with AVX512-BF16 bf16 is 2-4x fp32. Lightning's built-in says
nothing; the plugin says it once, at setup, with the factor timed on this machine (a small matmul, only where the
instructions are missing).
"""

from __future__ import annotations

import time
from functools import lru_cache
from pathlib import Path

import torch

#: CPU flags (``/proc/cpuinfo``) of bf16 matmul instructions: x86 AVX512-BF16 and AMX-BF16, Arm's BF16 extension.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

_CHECKED = False  # the check below runs once per process (it may time a matmul)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's flags as ``/proc/cpuinfo`` lists them (``flags`` on x86, ``Features`` on Arm); empty elsewhere."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    flags: set[str] = set()
    for line in cpuinfo.read_text(errors="ignore").splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.split(":", 1)[1].split())
    return frozenset(flags)


def cpu_has_native_bf16() -> bool:
    """Whether the CPU has bf16 matmul instructions (x86: AVX512-BF16 or AMX-BF16; Arm: BF16). Not Linux (no
    ``/proc/cpuinfo``): assumed so, as Lightning assumes."""
    flags = cpu_flags()
    return not flags or bool(flags & set(NATIVE_BF16_FLAGS))


def bf16_matmul_slowdown(size: int = 128, repeats: int = 3) -> float:
    """How many times longer a ``size`` x ``size`` bf16 matmul takes than the fp32 one on this CPU (best of
    ``repeats`` each, after a warm-up): about 0.3-0.5 with native bf16, 10-300 on torch's fallback kernel."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - start)
        timings[dtype] = best
    return timings[torch.bfloat16] / max(timings[torch.float32], 1e-9)


def warn_bf16_without_native_instructions(precision: str = "bf16-mixed") -> None:
    """Warn that bf16 runs on torch's slow fallback here: on a CPU whose flags list no bf16 instructions and where a
    bf16 matmul timed now is at least twice the fp32 one (timed twice before it says nothing: a timing under load can
    be far off). Checked once per process."""
    global _CHECKED
    if _CHECKED:
        return
    _CHECKED = True
    if cpu_has_native_bf16():
        return
    slowdown = bf16_matmul_slowdown()
    if slowdown < 2.0:  # timed again, longer, before staying silent: under load one timing can be far off (0.08 seen)
        slowdown = bf16_matmul_slowdown(repeats=15)
    if slowdown < 2.0:
        return
    from lightning.pytorch.utilities import rank_zero_warn  # here: this module alone needs torch only

    rank_zero_warn(
        f"MixedPrecisionPlugin(precision={precision!r}) on a CPU without native bf16: its flags list none of "
        f"{', '.join(NATIVE_BF16_FLAGS)} (AVX512-BF16, AMX-BF16, Arm BF16), so torch runs bf16 matmuls on a fallback "
        f"kernel, {slowdown:.0f}x the time of fp32 here (a 128x128 matmul timed at setup): a bf16 training step is "
        "many times slower than fp32. Train in fp32 on this machine (no plugin, or precision='32-true'); bf16-mixed "
        "or 16-mixed on a GPU; on a CPU with AVX512-BF16 or AMX, bf16-mixed is faster than fp32."
    )
