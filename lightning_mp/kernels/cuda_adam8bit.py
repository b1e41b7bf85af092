"""torchao's 8-bit Adam/AdamW step on lean master weights in one pass on CUDA: one Triton kernel per param group and
step, the arithmetic of ``lean_adam8bit.c`` (the CPU kernel) operation for operation.

Each program updates ``ROWS`` quantization blocks of one parameter (a tile of ``ROWS x COLS`` elements, ``COLS`` the
block size rounded up to a power of two): it joins the bf16 weights and int16 remainders into the exact fp32 masters,
dequantizes the blocks' moments (``qmap[code] * scale``), applies torchao's step in fp32, splits the weights back,
takes each block's new scale (its largest ``|m|``, at least 1e-12) and requantizes with torchao's branchless binary
search of the map and its round-up: every byte read and written once. A parameter whose torchao state is plain fp32
(under 4096 elements, or not whole blocks) is updated in tiles of ``COLS`` elements with its moments stored unquantized.
The tile (``ROWS x COLS``, 2048 elements) and the warps per program (4) are set by :func:`launch_shape`
(``LIGHTNING_MP_TRITON_8BIT_CONFIG``; ``benchmarks/adam8bit_alone.py --device cuda --tune`` times each shape).

Every fp32 operation is one IEEE operation in the C kernel's order (``div_rn``, ``sqrt_rn``, and launched with
``enable_fp_fusion=False``: no multiply-add is contracted), so where the inputs are the same the bits are the C
kernel's, which are torchao's compiled CPU step's (``tests/test_cuda_adam8bit.py`` compares them under Triton's
interpreter; on a GPU, ``tests/test_cuda_adam8bit.py``'s GPU test compares with torchao's own CUDA step).

What a step reads from the host: torchao keeps each parameter's step count and the group's ``lr`` in CPU tensors
(its compiled step forms ``1 - beta ** step`` on the CPU, where they live). The bias terms are formed there by the C
library's ``lean_adam8bit_bias`` (the CPU kernel's ``powf`` and ``sqrtf``, one call for the group), and reach the
device as one small copy (pinned, asynchronous). So the path needs the C kernel built too. A skip flag on the device
masks every write of the launch; the counts, on the host, then advance after backward for the parameters whose flag
was 0 (one read of the flags per step, :meth:`~lightning_mp.master.lean.eightbit.Adam8bitStep.end_params`).
"""

from __future__ import annotations

import ctypes
import math
import os
import struct
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_mp.kernels import adam8bit
from lightning_mp.kernels.cuda import to_device

_kernels: dict[str, Any] = {}
#: elements a program updates at most (``ROWS`` blocks of ``COLS``), and the fewest columns of a tile
TILE = 2048
MIN_COLS = 256
#: warps per program (Triton's default)
WARPS = 4
#: the setting of the launch shape, ``TILE,WARPS`` (not tuned on a GPU yet: ``benchmarks/adam8bit_alone.py --tune``)
CONFIG_VARIABLE = "LIGHTNING_MP_TRITON_8BIT_CONFIG"


def launch_shape() -> tuple[int, int]:
    """``(tile, warps)``: :data:`TILE` and :data:`WARPS`, or ``LIGHTNING_MP_TRITON_8BIT_CONFIG=TILE,WARPS`` where set
    (powers of two, ``TILE`` from 256 to 65536 elements, ``WARPS`` from 1 to 32), read when a layout is made. The
    shape changes which program updates which blocks, never a value: every element's arithmetic is the same."""
    text = os.environ.get(CONFIG_VARIABLE)
    if not text:
        return TILE, WARPS
    try:
        tile, warps = (int(part) for part in text.split(","))
    except ValueError:
        tile = warps = 0
    if not (MIN_COLS <= tile <= 65536 and 1 <= warps <= 32) or tile & (tile - 1) or warps & (warps - 1):
        raise ValueError(
            f"{CONFIG_VARIABLE}={text!r}: expected TILE,WARPS, powers of two with TILE from 256 to 65536 elements "
            "and WARPS from 1 to 32, for example 4096,8"
        )
    return tile, warps


#: where the kernel reads each field of a piece's row (:data:`~lightning_mp.kernels.adam8bit.PIECE_FIELDS`: the
#: gradient's and the step count's are not read from the row), as the kernel's constants
_AT = {
    f"{name.upper()}_AT": adam8bit.PIECE_FIELDS.index(name)
    for name in ("high", "low", "codes1", "scale1", "qmap1", "codes2", "scale2", "qmap2", "state1", "state2", "n",
                 "block", "grad_fp32")
}  # fmt: skip


def _kernel() -> Any:
    if "adam8bit" in _kernels:
        return _kernels["adam8bit"]
    import triton
    import triton.language as tl

    @triton.jit
    def _search(x, qmap):
        # torchao's quantize_8bit_with_qmap of x (already divided by its block's scale), comparison for comparison
        codes = tl.where(x >= tl.load(qmap + 128), 128, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 64), 64, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 32), 32, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 16), 16, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 8), 8, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 4), 4, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 2), 2, 0)
        codes += tl.where(x >= tl.load(qmap + codes + 1), 1, 0)
        up = tl.minimum(codes + 1, 255)
        down = tl.load(qmap + codes)
        residual = x - down
        return tl.where(residual >= (tl.load(qmap + up) - down) * 0.5, up, codes)

    @triton.jit
    def _larger(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _scale_of(x, mask):
        # a row's largest |x| as bits (the order of non-negative floats); a NaN kept as the all-ones pattern the CPU
        # kernel (and inductor's x86 amax) makes of it; at least 1e-12
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        amax = tl.reduce(bits, 1, _larger)  # (tl.max, with a combine of our own: interpretable)
        nan = amax > 0x7F800000
        amax = tl.where(nan, -1, amax)
        value = amax.to(tl.float32, bitcast=True)
        return tl.where(nan | (value > 1e-12), value, 1e-12)

    # the kernel calls these by their module-level names (Triton resolves a jitted callee among its globals)
    globals().update(_search=_search, _scale_of=_scale_of, _larger=_larger)

    @triton.jit
    def lean_adam8bit_kernel(
        table, grads, program_piece, program_start, bias, grad_mul, found, lr, weight_decay, eps, t1, t2, bound,
        ADAMW: tl.constexpr, BIG1: tl.constexpr, BIG2: tl.constexpr, HAS_MUL: tl.constexpr, CLAMPED: tl.constexpr,
        HAS_FOUND: tl.constexpr,
        ROWS: tl.constexpr, COLS: tl.constexpr, FIELDS: tl.constexpr, HIGH_AT: tl.constexpr, LOW_AT: tl.constexpr,
        CODES1_AT: tl.constexpr, SCALE1_AT: tl.constexpr, QMAP1_AT: tl.constexpr, CODES2_AT: tl.constexpr,
        SCALE2_AT: tl.constexpr, QMAP2_AT: tl.constexpr, STATE1_AT: tl.constexpr, STATE2_AT: tl.constexpr,
        N_AT: tl.constexpr, BLOCK_AT: tl.constexpr, GRAD_FP32_AT: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        piece = tl.load(program_piece + pid).to(tl.int64)
        start = tl.load(program_start + pid)
        row = table + piece * FIELDS
        n = tl.load(row + N_AT)
        codes1_address = tl.load(row + CODES1_AT)
        quantized = codes1_address != 0
        block = tl.where(quantized, tl.load(row + BLOCK_AT), COLS)  # fp32 state: tiles of COLS elements
        rows = tl.arange(0, ROWS)[:, None]
        cols = tl.arange(0, COLS)[None, :]
        first = start + rows * block  # each row's first element (a block's, where quantized)
        offsets = first + cols
        mask = (cols < block) & (offsets < n)
        row_mask = first < n
        if HAS_FOUND:  # a skipped step: every load and store masked off (the flag read in the masks' shapes)
            mask = mask & (tl.load(found + tl.full([ROWS, COLS], 0, tl.int32)) == 0)
            row_mask = row_mask & (tl.load(found + tl.full([ROWS, 1], 0, tl.int32)) == 0)
        # every address read up front (0 where the piece has none: never dereferenced then)
        high_ptr = tl.load(row + HIGH_AT).to(tl.pointer_type(tl.int16))
        w32_ptr = tl.load(row + HIGH_AT).to(tl.pointer_type(tl.float32))
        low_address = tl.load(row + LOW_AT)
        low_ptr = low_address.to(tl.pointer_type(tl.int16))
        lean = low_address != 0
        qmap1 = tl.load(row + QMAP1_AT).to(tl.pointer_type(tl.float32))
        qmap2 = tl.load(row + QMAP2_AT).to(tl.pointer_type(tl.float32))
        scale1_ptr = tl.load(row + SCALE1_AT).to(tl.pointer_type(tl.float32))
        scale2_ptr = tl.load(row + SCALE2_AT).to(tl.pointer_type(tl.float32))
        codes1_ptr = codes1_address.to(tl.pointer_type(tl.uint8))
        codes2_ptr = tl.load(row + CODES2_AT).to(tl.pointer_type(tl.uint8))
        state1_ptr = tl.load(row + STATE1_AT).to(tl.pointer_type(tl.float32))
        state2_ptr = tl.load(row + STATE2_AT).to(tl.pointer_type(tl.float32))
        if lean:  # bf16 weights and int16 remainders, joined exactly
            high = tl.load(high_ptr + offsets, mask=mask, other=0).to(tl.int32)
            low = tl.load(low_ptr + offsets, mask=mask, other=0).to(tl.int32)
            w = ((high << 16) + low).to(tl.float32, bitcast=True)
        else:  # an fp32 parameter, updated in place
            w = tl.load(w32_ptr + offsets, mask=mask, other=0.0)
        if tl.load(row + GRAD_FP32_AT) != 0:
            g = tl.load(tl.load(grads + piece).to(tl.pointer_type(tl.float32)) + offsets, mask=mask, other=0.0)
        else:
            g16 = tl.load(tl.load(grads + piece).to(tl.pointer_type(tl.bfloat16)) + offsets, mask=mask, other=0.0)
            g = g16.to(tl.float32)
        if HAS_MUL:
            g = g * tl.load(grad_mul)
        if CLAMPED:  # torch's clamp_min_ then clamp_max_ (a NaN stays)
            g = tl.where(g < -bound, -bound, g)
            g = tl.where(g > bound, bound, g)
        if ADAMW:
            w = w - (lr * weight_decay) * w
        else:
            g = g + w * weight_decay
        g2 = g * g
        scale_rows = first // block  # each row's block (quantized)
        if quantized:
            codes1 = tl.load(codes1_ptr + offsets, mask=mask, other=0).to(tl.int32)
            codes2 = tl.load(codes2_ptr + offsets, mask=mask, other=0).to(tl.int32)
            m0 = tl.load(qmap1 + codes1, mask=mask, other=0.0) * tl.load(scale1_ptr + scale_rows, mask=row_mask)
            v0 = tl.load(qmap2 + codes2, mask=mask, other=0.0) * tl.load(scale2_ptr + scale_rows, mask=row_mask)
        else:
            m0 = tl.load(state1_ptr + offsets, mask=mask, other=0.0)
            v0 = tl.load(state2_ptr + offsets, mask=mask, other=0.0)
        # lerp as inductor decomposes it: a + (b - a) * t where |t| < 0.5, else b + (b - a) * (t - 1)
        if BIG1:
            m = g + (g - m0) * t1
        else:
            m = m0 + (g - m0) * t1
        if BIG2:
            v = g2 + (g2 - v0) * t2
        else:
            v = v0 + (g2 - v0) * t2
        bc1 = tl.load(bias + 2 * piece)
        bc2_sqrt = tl.load(bias + 2 * piece + 1)
        w = w - tl.math.div_rn(lr * tl.math.div_rn(m, bc1), tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps)
        if lean:
            bits = w.to(tl.int32, bitcast=True)
            rounded = (bits + 0x8000) >> 16
            rounded = tl.where(w != w, (bits >> 16) | 0x0040, rounded)
            tl.store(high_ptr + offsets, rounded.to(tl.int16), mask=mask)
            tl.store(low_ptr + offsets, bits.to(tl.int16), mask=mask)
        else:
            tl.store(w32_ptr + offsets, w, mask=mask)
        if quantized:
            scale1 = _scale_of(m, mask)
            scale2 = _scale_of(v, mask)
            tl.store(codes1_ptr + offsets, _search(tl.math.div_rn(m, scale1[:, None]), qmap1).to(tl.uint8), mask=mask)
            tl.store(codes2_ptr + offsets, _search(tl.math.div_rn(v, scale2[:, None]), qmap2).to(tl.uint8), mask=mask)
            row_mask1 = tl.reshape(row_mask, [ROWS])
            scale_at = tl.reshape(scale_rows, [ROWS])
            tl.store(scale1_ptr + scale_at, scale1, mask=row_mask1)
            tl.store(scale2_ptr + scale_at, scale2, mask=row_mask1)
        else:
            tl.store(state1_ptr + offsets, m, mask=mask)
            tl.store(state2_ptr + offsets, v, mask=mask)

    _kernels["adam8bit"] = lean_adam8bit_kernel
    return lean_adam8bit_kernel


def _fp32(value: float) -> float:
    """``value`` rounded to fp32 (as a Python float): the kernel's fp32 scalar arguments, exactly (no tensor made;
    a value beyond fp32's range is an infinity, as the C cast makes it)."""
    try:
        return float(_FLOAT.unpack(_FLOAT.pack(value))[0])
    except OverflowError:
        return math.copysign(math.inf, value)


_FLOAT = struct.Struct("f")


class Adam8bitLaunch:
    """What one group's launch reads, laid out once (:class:`~lightning_mp.master.lean.eightbit._GroupLayout` keeps
    it): the pieces' rows (:data:`~lightning_mp.kernels.adam8bit.PIECE_FIELDS`, addresses on ``device``) as an int64
    table on the device, each program's piece and first element, the tile shape; and on the host the step counts'
    and steps' addresses for ``lean_adam8bit_bias``. Per step only the gradients' addresses travel."""

    def __init__(self, rows: list[int], steps: list[Tensor], device: torch.device) -> None:
        fields = len(adam8bit.PIECE_FIELDS)
        count = len(rows) // fields
        self.count = count
        self.device = device
        at = adam8bit.PIECE_FIELDS.index
        blocks = [rows[k * fields + at("block")] for k in range(count) if rows[k * fields + at("codes1")]]
        widest = max(blocks, default=1)
        tile, self.warps = launch_shape()
        self.cols = max(MIN_COLS, 1 << (widest - 1).bit_length())
        self.rows = max(1, tile // self.cols)
        pieces, starts = [], []
        for k in range(count):
            row = rows[k * fields : (k + 1) * fields]
            span = (row[at("block")] if row[at("codes1")] else self.cols) * self.rows
            for start in range(0, row[at("n")], span):
                pieces.append(k)
                starts.append(start)
        self.programs = len(pieces)
        self.host_rows = list(rows)
        self.table = to_device(torch.tensor(rows or [0], dtype=torch.int64), device)
        self.program_piece = to_device(torch.tensor(pieces or [0], dtype=torch.int32), device)
        self.program_start = to_device(torch.tensor(starts or [0], dtype=torch.int64), device)
        self.counts = adam8bit.counts_of(steps)
        self.steps = (ctypes.c_void_p * max(1, count))(*[s.data_ptr() for s in steps])
        self.grads: list[int] = []
        self.grads_on_device: Optional[Tensor] = None

    def set_grad_dtypes(self, fp32: list[bool]) -> None:
        """Which pieces' gradients are fp32 (the others bf16) from now on: the rows' ``grad_fp32`` field, sent again."""
        fields, at = len(adam8bit.PIECE_FIELDS), adam8bit.PIECE_FIELDS.index("grad_fp32")
        self.host_rows[at::fields] = [int(flag) for flag in fp32]
        self.table = to_device(torch.tensor(self.host_rows or [0], dtype=torch.int64), self.device)

    def run(
        self,
        grads: list[Tensor],
        *,
        lr: Tensor,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adamw: bool,
        grad_mul: Optional[Tensor] = None,
        clamp: Optional[float] = None,
        found: Optional[Tensor] = None,
    ) -> None:
        """One step of the pieces with ``grads`` (contiguous, bf16 or fp32 as the rows say, on the device): the bias
        terms formed on the host, then one launch. ``grad_mul``: a 1-element fp32 tensor on the device (or ``None``);
        ``clamp``: a clip-by-value bound after it. ``found``: ``None``, and the step counts advance here (the caller
        has decided on the host that the step runs); or a 1-element fp32 flag on the device, and the launch writes
        nothing where it is nonzero while the counts stay as they are: the caller advances them where the flag was 0
        (:meth:`~lightning_mp.master.lean.eightbit.Adam8bitStep.end_params`)."""
        library = adam8bit.cpu_kernel()
        if library is None:
            raise RuntimeError("the 8-bit kernel's host part (lean_adam8bit_bias) is not built here")
        addresses = [g.data_ptr() for g in grads]
        if addresses != self.grads:
            self.grads = addresses
            self.grads_on_device = to_device(torch.tensor(addresses, dtype=torch.int64), self.device)
        pinned = self.device.type == "cuda"
        bias = torch.empty(2 * self.count, dtype=torch.float32, pin_memory=pinned)
        library.lean_adam8bit_bias(
            self.counts, len(self.counts), self.steps, self.count, float(beta1), float(beta2), int(found is None),
            bias.data_ptr(),
        )  # fmt: skip
        bias = bias.to(self.device, non_blocking=pinned)
        t1, t2 = 1.0 - beta1, 1.0 - beta2  # Python's `1 - beta`, a double
        big1, big2 = abs(t1) >= 0.5, abs(t2) >= 0.5
        _kernel()[(self.programs,)](
            self.table, self.grads_on_device, self.program_piece, self.program_start, bias,
            grad_mul if grad_mul is not None else bias, found if found is not None else bias, _fp32(float(lr)),
            _fp32(weight_decay), _fp32(eps), _fp32(t1 - 1.0 if big1 else t1), _fp32(t2 - 1.0 if big2 else t2),
            _fp32(clamp) if clamp is not None else 0.0,
            ADAMW=adamw, BIG1=big1, BIG2=big2, HAS_MUL=grad_mul is not None, CLAMPED=clamp is not None,
            HAS_FOUND=found is not None, ROWS=self.rows, COLS=self.cols, FIELDS=len(adam8bit.PIECE_FIELDS),
            **_AT, enable_fp_fusion=False, num_warps=self.warps,
        )  # fmt: skip


__all__ = ["Adam8bitLaunch", "launch_shape"]
