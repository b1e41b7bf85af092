"""An fp32 value as a rounded bf16 half plus a signed 16-bit remainder, exactly.

An fp32 bit pattern ``b`` (32 bits) is split into

- ``high`` (bf16, what the model's forward sees): ``(b + 0x8000) >> 16``, the value rounded to the nearest bf16,
  ties away from zero (the carry of a tie goes into the magnitude bits);
- ``low`` (int16, the remainder): the low 16 bits of ``b`` read as a *signed* number, in ``[-32768, 32767]``.

and joined back by ``b = (high << 16) + low`` in 32-bit arithmetic. Proof: if ``b``'s low half ``l`` is below
``0x8000`` the high half is ``b``'s own top half ``t`` and ``low = l``; otherwise the rounding carried one into
it (``t + 1``) and ``low = l - 0x10000``: ``(t + 1) * 0x10000 + l - 0x10000 = t * 0x10000 + l``. All arithmetic is
modulo 2**32, so it holds for negative numbers, subnormals, zeros and infinities, and at the ends of the range
(a finite value that rounds to a bf16 infinity still joins back to itself).

Why rounding and not truncation: the forward then sees the bf16 value nearest to the fp32 master, as with fp32
master weights copied to the model (which round to nearest even); the two differ only on exact ties (one value in
65536), where round-to-nearest-even would need a 17th bit to be undone.

NaN: a NaN whose top half happens to be 0x7FFF/0xFFFF would carry into the sign bit and show the forward a zero,
and one whose mantissa bits are all in the low half would show an infinity. So NaNs are split as a quiet NaN high
half (``t | 0x0040``) and their low bits; the join is still a NaN (its low mantissa bits may differ). Every
non-NaN fp32 value round-trips bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_mp.kernels import native

_QUIET_BIT = 0x0040  # bf16's quiet-NaN mantissa bit


def split_fp32(value: Tensor) -> tuple[Tensor, Tensor]:
    """``(high, low)``: ``value`` (fp32) as its bf16 rounding and the signed int16 remainder (see module doc)."""
    high = torch.empty(value.shape, dtype=torch.bfloat16, device=value.device)
    low = torch.empty(value.shape, dtype=torch.int16, device=value.device)
    split_fp32_into(value, high, low)
    return high, low


def split_fp32_into(value: Tensor, high: Tensor, low: Tensor) -> None:
    """Write ``value``'s (fp32) split into ``high`` (bf16) and ``low`` (int16), which may be views."""
    bits = value.view(torch.int32)
    rounded = torch.bitwise_right_shift(bits + 0x8000, 16)
    nan = torch.isnan(value)
    rounded = torch.where(nan, torch.bitwise_right_shift(bits, 16) | _QUIET_BIT, rounded)
    high.view(torch.int16).copy_(rounded)  # int32 -> int16 keeps the low 16 bits (the cast wraps)
    low.copy_(bits)


def join_fp32(high: Tensor, low: Tensor, out: Tensor | None = None) -> Tensor:
    """The fp32 value of ``high`` (bf16) and ``low`` (int16): ``(high << 16) + low`` in 32-bit arithmetic."""
    bits = torch.bitwise_left_shift(high.view(torch.int16).to(torch.int32), 16).add_(low)
    if out is None:
        return bits.view(torch.float32)
    out.view(torch.int32).copy_(bits)
    return out


def join_fp32_into(high: Tensor, low: Tensor, out: Tensor) -> Tensor:
    """Like :func:`join_fp32` writing into ``out`` (fp32), with one temporary less."""
    bits = out.view(torch.int32)
    bits.copy_(high.view(torch.int16))
    bits.bitwise_left_shift_(16).add_(low)
    return out


class JoinSplit:
    """The join and split a lean store runs, by the fastest means here, the same bits whichever runs: one compiled
    pass (:mod:`lightning_mp.kernels.native`) on plain contiguous CPU tensors where the kernel is built; elsewhere the
    eager ops above, the split compiled with ``torch.compile`` when ``compile`` is true (about ten eager passes with
    its NaN rule gain; the join, three, does not)."""

    def __init__(self, compile: bool = False) -> None:
        self.compile = compile
        self._compiled_split: Optional[Callable[..., Any]] = None

    def join_into(self, high: Tensor, low: Tensor, out: Tensor) -> Tensor:
        """``out`` (fp32) = the join of ``high`` (bf16) and ``low`` (int16)."""
        if _native_ok(high, low, out):
            return native.join(high, low, out)
        return join_fp32_into(high, low, out)

    def split_into(self, value: Tensor, high: Tensor, low: Tensor) -> None:
        """``high`` (bf16), ``low`` (int16) = the split of ``value`` (fp32)."""
        if _native_ok(value, high, low):
            return native.split(value, high, low)
        if not self.compile:
            return split_fp32_into(value, high, low)
        if self._compiled_split is None:  # made on first use: a compiled function does not pickle (ddp_spawn)
            self._compiled_split = torch.compile(split_fp32_into, dynamic=True)
        return self._compiled_split(value, high, low)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_compiled_split": None}


def _native_ok(*tensors: Tensor) -> bool:
    """Whether the compiled join/split can take these tensors: plain contiguous CPU tensors, kernel built."""
    if not all(t.device.type == "cpu" and t.is_contiguous() and type(t) is Tensor for t in tensors):
        return False
    return native.enabled() and native.cpu_kernel() is not None
