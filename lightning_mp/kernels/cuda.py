"""The one-pass lean update on CUDA: one Triton kernel per param group and step (Triton ships with CUDA builds of
torch; without it, the chunked path runs, after one warning).

Each program of the kernel updates ``CHUNK`` elements of one tensor, ``BLOCK`` at a time: it joins the bf16 weights
and int16 remainders into fp32, applies the optimizer's arithmetic and splits the result back, reading and writing
each byte once. Which tensor and where: a table of ``(tensor, start)`` per program, built once per set of tensor
sizes; the tensors' addresses: a small int64 table, copied to the device (pinned, asynchronously) only when an
address changed. Adam's bias terms are formed per tensor from its step count on the device by a second, tiny
kernel (one launch), which also advances the counts for a step plan (:mod:`lightning_mp.master.lean.plan`). :data:`CONFIG` holds the launch shape (``BLOCK``, ``CHUNK``, warps) and the arithmetic, chosen
on an H100 by ``benchmarks/kernel_contract.py --tune``; ``LIGHTNING_MP_TRITON_CONFIG=BLOCK,CHUNK,WARPS[,PRECISE]``
overrides it.

Arithmetic, by default *precise*: every intermediate in fp64 (the optimizer's options are doubles, as torch's
kernels take them) and each stored value rounded to fp32 once, so each weight and state is the float64 evaluation
of the formula correctly rounded (0.5 ulp from it on an H100, where torch's CUDA kernel is up to 299 ulp away:
cancellation in its fp32 variables). The other arithmetic, ``PRECISE=0``, is torch's CUDA kernel's
(``fused_adam_utils.cuh``, ``FusedSgdKernel.cu``: fp32 variables, fp64 terms) with IEEE division and square root
(Triton's default fp32 division is approximate): up to 9.3 ulp, 4% faster. Either meets the contract of
:mod:`lightning_mp.kernels.contract`; neither is bitwise torch's CUDA kernel (its compiler contracts
multiply-adds its own way).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch
from torch import Tensor

from lightning_mp.kernels.options import ADAMW, FLOAT_OPTIONS, SGD

#: Where each floating option sits in the kernel's option vector (native.FLOAT_OPTIONS), as the kernel's constants.
_AT = {f"{name.upper()}_AT": index for index, name in enumerate(FLOAT_OPTIONS)}
_kernels: dict[str, Any] = {}


class LaunchConfig(NamedTuple):
    """The kernel's launch shape: elements per vector ``block``, elements per program ``chunk`` (a multiple of
    ``block``), warps per program; and the arithmetic of Adam's weight update: ``precise`` (from the unrounded
    moments in fp64, rounded once) or torch's (fp32 with IEEE division)."""

    block: int
    chunk: int
    warps: int
    precise: bool = False


#: the default launch shape and arithmetic: the fastest precise shape on an H100 by ``benchmarks/kernel_contract.py
#: --tune`` (its figures: benchmarks/RESULTS.md)
CONFIG = LaunchConfig(block=512, chunk=512, warps=4, precise=True)


def launch_config() -> LaunchConfig:
    """:data:`CONFIG`, or ``LIGHTNING_MP_TRITON_CONFIG=BLOCK,CHUNK,WARPS[,PRECISE]`` where set (checked: powers of
    two, ``CHUNK`` a multiple of ``BLOCK``, ``PRECISE`` 0 or 1)."""
    text = os.environ.get("LIGHTNING_MP_TRITON_CONFIG")
    if not text:
        return CONFIG
    try:
        numbers = [int(part) for part in text.split(",")]
        if len(numbers) < 3:
            raise ValueError(text)
        precise = bool(numbers[3]) if len(numbers) == 4 else CONFIG.precise
        config = LaunchConfig(numbers[0], numbers[1], numbers[2], precise)
        valid = len(numbers) in (3, 4) and numbers[3:] in ([], [0], [1])
    except (TypeError, ValueError):
        valid = False
    if not valid or any(v <= 0 or v & (v - 1) for v in config[:3]) or config.chunk % config.block:
        raise ValueError(
            f"LIGHTNING_MP_TRITON_CONFIG={text!r}: expected powers of two BLOCK,CHUNK,WARPS with CHUNK a multiple "
            "of BLOCK, then optionally PRECISE (0 or 1), for example 1024,4096,4 or 1024,4096,4,1"
        )
    return config


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernel() -> Any:
    if "adam" in _kernels:
        return _kernels["adam"]
    import triton
    import triton.language as tl

    @triton.jit
    def lean_update_kernel(
        table, block_tensor, block_start, scalars, found, grad_mul, option_values,
        KIND: tl.constexpr, GRAD_FP32: tl.constexpr, AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr,
        NESTEROV: tl.constexpr, FIRST: tl.constexpr, HAS_MUL: tl.constexpr, CLAMPED: tl.constexpr,
        HAS_FOUND: tl.constexpr, HAS_MOMENTUM: tl.constexpr, PRECISE: tl.constexpr, BLOCK: tl.constexpr,
        CHUNK: tl.constexpr, SGD_KIND: tl.constexpr, ADAMW_KIND: tl.constexpr, LR_AT: tl.constexpr,
        BETA1_AT: tl.constexpr, BETA2_AT: tl.constexpr, WEIGHT_DECAY_AT: tl.constexpr, EPS_AT: tl.constexpr,
        MOMENTUM_AT: tl.constexpr, DAMPENING_AT: tl.constexpr, CLAMP_AT: tl.constexpr,
    ):  # fmt: skip
        # the kinds and where each option sits in option_values: native.KINDS and native.FLOAT_OPTIONS (_AT)
        pid = tl.program_id(0)
        lr = tl.load(option_values + LR_AT)  # fp64, as torch's kernels take the optimizer's options
        beta1 = tl.load(option_values + BETA1_AT)
        beta2 = tl.load(option_values + BETA2_AT)
        weight_decay = tl.load(option_values + WEIGHT_DECAY_AT)
        eps = tl.load(option_values + EPS_AT)
        momentum = tl.load(option_values + MOMENTUM_AT)
        dampening = tl.load(option_values + DAMPENING_AT)
        clamp = tl.load(option_values + CLAMP_AT).to(tl.float32)
        t = tl.load(block_tensor + pid).to(tl.int64)
        start = tl.load(block_start + pid)
        row = table + t * 8
        high_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
        low_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        n = tl.load(row + 6)
        s1_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        s2_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        s3_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
        if GRAD_FP32:
            g32_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
        else:
            g16_ptr = tl.load(row + 2).to(tl.pointer_type(tl.bfloat16))
        if HAS_FOUND:  # a skipped step: every load and store masked off
            go = tl.load(found) == 0
        if HAS_MUL:
            factor = tl.load(grad_mul)
        if KIND != SGD_KIND:
            if PRECISE:  # fp64 bias terms (scalars: fp64, 4 per tensor; :func:`_bias_scalars`)
                step_size = tl.load(scalars + t * 4 + 2)
                bc2_sqrt = tl.load(scalars + t * 4 + 3)
            else:  # torch's: fp32
                step_size = tl.load(scalars + t * 4).to(tl.float32)
                bc2_sqrt = tl.load(scalars + t * 4 + 1).to(tl.float32)
        for first in tl.range(0, CHUNK, BLOCK):
            offsets = start + first + tl.arange(0, BLOCK)
            mask = offsets < n
            if HAS_FOUND:
                mask = mask & go
            high = tl.load(high_ptr + offsets, mask=mask, other=0).to(tl.int32)
            low = tl.load(low_ptr + offsets, mask=mask, other=0).to(tl.int32)
            w = ((high << 16) + low).to(tl.float32, bitcast=True)
            if GRAD_FP32:
                g = tl.load(g32_ptr + offsets, mask=mask, other=0.0)
            else:
                g = tl.load(g16_ptr + offsets, mask=mask, other=0.0)
                g = g.to(tl.float32)
            if HAS_MUL:
                g = g * factor
            if CLAMPED:
                g = tl.where(g < -clamp, -clamp, g)
                g = tl.where(g > clamp, clamp, g)
            if MAXIMIZE:
                g = -g
            # fp64 terms as torch's CUDA kernels form them; PRECISE keeps every intermediate in fp64 and rounds each
            # stored value once, torch's arithmetic rounds where its kernel holds an fp32 variable
            w64 = w.to(tl.float64)
            d = g.to(tl.float64)
            if KIND == SGD_KIND:
                if weight_decay != 0:
                    d = d + weight_decay * w64
                    if not PRECISE:
                        d = d.to(tl.float32).to(tl.float64)
                if HAS_MOMENTUM:
                    if FIRST:
                        buf = d
                    else:
                        old = tl.load(s1_ptr + offsets, mask=mask, other=0.0)
                        buf = momentum * old.to(tl.float64) + (1 - dampening) * d
                    tl.store(s1_ptr + offsets, buf.to(tl.float32), mask=mask)
                    if NESTEROV:
                        d = d + momentum * buf  # torch's buffer here is a double
                    else:
                        d = buf
                    if not PRECISE:
                        d = d.to(tl.float32).to(tl.float64)
                w = (w64 - lr * d).to(tl.float32)
            else:
                if weight_decay != 0:
                    if KIND == ADAMW_KIND:  # param -= lr * weight_decay * param
                        w64 = w64 - lr * weight_decay * w64
                        if not PRECISE:
                            w64 = w64.to(tl.float32).to(tl.float64)
                    else:
                        d = d + w64 * weight_decay
                        if not PRECISE:
                            d = d.to(tl.float32).to(tl.float64)
                m64 = beta1 * tl.load(s1_ptr + offsets, mask=mask, other=0.0).to(tl.float64) + (1 - beta1) * d
                v64 = beta2 * tl.load(s2_ptr + offsets, mask=mask, other=0.0).to(tl.float64) + (1 - beta2) * d * d
                m = m64.to(tl.float32)
                v = v64.to(tl.float32)
                tl.store(s1_ptr + offsets, m, mask=mask)
                tl.store(s2_ptr + offsets, v, mask=mask)
                if AMSGRAD:
                    old_max = tl.load(s3_ptr + offsets, mask=mask, other=0.0)
                    tl.store(s3_ptr + offsets, tl.maximum(old_max, v), mask=mask)
                    v = tl.maximum(old_max, v)
                    v64 = tl.maximum(old_max.to(tl.float64), v64)
                if PRECISE:
                    w = (w64 - step_size * m64 / (tl.sqrt(v64) / bc2_sqrt + eps)).to(tl.float32)
                else:  # fp32, IEEE-rounded division and square root
                    denom = (tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
                    w = w64.to(tl.float32) - tl.math.div_rn(step_size * m, denom)
            bits = w.to(tl.int32, bitcast=True)
            rounded = (bits + 0x8000) >> 16
            rounded = tl.where(w != w, (bits >> 16) | 0x0040, rounded)
            tl.store(high_ptr + offsets, rounded.to(tl.int16), mask=mask)
            tl.store(low_ptr + offsets, bits.to(tl.int16), mask=mask)

    @triton.jit
    def bias_kernel(table, option_values, scalars, found, COUNT: tl.constexpr, HAS_FOUND: tl.constexpr):
        """Per tensor (one program each): Adam's bias terms from its step count on the device, as
        :func:`_bias_scalars` computes them with torch ops (one launch instead of about sixteen). ``COUNT``: the
        count advances here first, and the found flag is taken off it (the C kernel's ``lean_step``: torch's
        ``_foreach_add_(steps, 1)`` and ``_foreach_sub_(steps, found)``; the update reads the terms, not the count)."""
        t = tl.program_id(0)
        step_ptr = tl.load(table + t * 8 + 7).to(tl.pointer_type(tl.float32))
        step = tl.load(step_ptr)
        if COUNT:
            step = step + 1.0
            if HAS_FOUND:
                tl.store(step_ptr, step - tl.load(found))
            else:
                tl.store(step_ptr, step)
        lr = tl.load(option_values)
        beta1 = tl.load(option_values + 1)
        beta2 = tl.load(option_values + 2)
        exponent = step.to(tl.int64)  # a whole number: torch's step counts count steps
        power1 = beta1 * 0.0 + 1.0
        power2 = beta2 * 0.0 + 1.0
        base1 = beta1
        base2 = beta2
        for i in tl.static_range(40):  # beta ** step by squaring, in fp64 (steps below 2 ** 40)
            bit = (exponent >> i) & 1
            power1 = tl.where(bit == 1, power1 * base1, power1)
            power2 = tl.where(bit == 1, power2 * base2, power2)
            base1 = base1 * base1
            base2 = base2 * base2
        bias1 = 1.0 - power1
        bias2 = 1.0 - power2
        # torch's: fp32 bias corrections, lr / bias1 in fp64 rounded to fp32, sqrt in fp32
        tl.store(scalars + t * 4, (lr / bias1.to(tl.float32).to(tl.float64)).to(tl.float32).to(tl.float64))
        tl.store(scalars + t * 4 + 1, tl.sqrt_rn(bias2.to(tl.float32)).to(tl.float64))
        tl.store(scalars + t * 4 + 2, lr / bias1)  # precise: fp64
        tl.store(scalars + t * 4 + 3, tl.sqrt(bias2))

    _kernels["adam"] = lean_update_kernel
    _kernels["bias"] = bias_kernel
    return lean_update_kernel


#: elements of a gradient one program of the non-finite check reads
CHECK_BLOCK = 4096
#: at most this many gradients are checked by one launch each; a longer list goes to torch's foreach ops (a few
#: launches for the whole list)
CHECK_MAX_TENSORS = 8


def _check_kernel() -> Any:
    if "check" in _kernels:
        return _kernels["check"]
    import triton
    import triton.language as tl

    @triton.jit
    def nonfinite_kernel(grad, n, found, BLOCK: tl.constexpr):
        """``found`` (fp32) set to 1 where any of ``grad``'s ``n`` values is inf or NaN; read only, never reset
        (as torch's ``_amp_foreach_non_finite_check_and_unscale_``): every program that sees one stores the same 1."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(grad + offsets, mask=offsets < n, other=0.0).to(tl.float32)
        bad = (x != x) | (tl.abs(x) == float("inf"))
        # no reduction: each lane that holds one stores the same 1 to the flag (none in a clean gradient)
        tl.store(found + tl.full([BLOCK], 0, tl.int32), tl.full([BLOCK], 1.0, tl.float32), mask=bad)

    _kernels["check"] = nonfinite_kernel
    return nonfinite_kernel


def check_nonfinite(grads: list[Tensor], found: Tensor) -> bool:
    """Set ``found`` (a 1-element or 0-dim fp32 tensor on the gradients' device) to 1 if any of ``grads`` holds an
    inf or NaN, reading them only, one launch per gradient (no other op): the check of one parameter's bf16 gradient
    inside backward on CUDA, where torch's check takes no bf16 and the inf-norm way is about eight ops. ``False``
    (nothing done) where Triton is missing or the list is long, sparse or not contiguous."""
    if not grads or len(grads) > CHECK_MAX_TENSORS or found.dtype != torch.float32:
        return False
    if "check" not in _kernels and not triton_available():  # asked once: per parameter inside backward otherwise
        return False
    if not all(g.is_contiguous() and g.layout == torch.strided and g.device == found.device for g in grads):
        return False
    kernel = _check_kernel()
    for grad in grads:
        if grad.numel():
            kernel[(-(-grad.numel() // CHECK_BLOCK),)](grad, grad.numel(), found, BLOCK=CHECK_BLOCK)
    return True


class CudaLeanUpdate:
    """The per-group caches of the CUDA one-pass update: the program table per set of sizes, the address table."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
        self._tables: dict[int, tuple[list[int], Tensor]] = {}
        self._option_values: Optional[tuple[list[float], Tensor]] = None  # the last options, on the device
        self._scalars: dict[int, Tensor] = {}  # Adam's bias terms per tensor (fp64, 4 each), written on the device

    def run(
        self,
        key: int,
        rows: list[list[int]],
        steps: Optional[list[Tensor]],
        options: dict[str, Any],
        found: Optional[Tensor],
        grad_mul: Optional[Tensor],
        device: torch.device,
    ) -> None:
        """Update the tensors of ``rows`` (``[high, low, grad, state1, state2, state3, numel]`` addresses each);
        ``steps``: their step counts (fp32 tensors on ``device``, already advanced) for Adam, ``None`` for SGD."""
        on_device = steps is not None and all(s.device == device and s.dtype == torch.float32 for s in steps)
        step_addresses = [step.data_ptr() for step in steps] if steps is not None and on_device else [0] * len(rows)
        flat = [value for row, step in zip(rows, step_addresses) for value in (*row, step)]
        numels = tuple(row[6] for row in rows)
        self.launch(key, flat, numels, steps, on_device, options, found, grad_mul, device)

    def launch(
        self,
        key: int,
        flat: list[int],
        numels: tuple[int, ...],
        steps: Optional[list[Tensor]],
        on_device: bool,
        options: dict[str, Any],
        found: Optional[Tensor],
        grad_mul: Optional[Tensor],
        device: torch.device,
        count: bool = False,
    ) -> None:
        """:meth:`run` with the address table already flat (8 per tensor: the row, then its step count's address,
        0 where ``on_device`` is false) and the tensors' sizes: what a step plan (:mod:`lightning_mp.master.lean.plan`)
        keeps between steps. The table goes to the device only when it changed (a new list that differs). ``count``
        (with ``on_device``): the step counts advance in the bias kernel (``step += 1``, then ``step -= found``)."""
        config = launch_config()
        numels = (config.chunk, *numels)
        if numels not in self._blocks:
            tensors, starts = [], []
            for index, numel in enumerate(numels[1:]):
                for start in range(0, numel, config.chunk):
                    tensors.append(index)
                    starts.append(start)
            self._blocks[numels] = (
                torch.tensor(tensors, dtype=torch.int32, device=device),
                torch.tensor(starts, dtype=torch.int64, device=device),
            )
        block_tensor, block_start = self._blocks[numels]
        rows = len(numels) - 1
        cached = self._tables.get(key)
        if cached is None or (cached[0] is not flat and cached[0] != flat):
            self._tables[key] = cached = (flat, to_device(torch.tensor(flat, dtype=torch.int64), device))
        kernel = _kernel()
        option_values = self._options(options, device)
        scalars = block_start
        if on_device:
            made = self._scalars.get(key)
            if made is None or made.numel() != 4 * rows:
                self._scalars[key] = made = torch.empty(4 * rows, dtype=torch.float64, device=device)
            scalars = made
            flag = found if found is not None else scalars
            _kernels["bias"][(rows,)](cached[1], option_values, scalars, flag, COUNT=count, HAS_FOUND=found is not None)
        elif steps is not None:  # step counts elsewhere (a state loaded from a checkpoint onto the CPU): torch ops
            scalars = _bias_scalars(steps, options, device)
        kind = options["kind"]
        kernel[(block_tensor.numel(),)](
            cached[1], block_tensor, block_start, scalars,
            found if found is not None else block_start, grad_mul if grad_mul is not None else block_start,
            option_values,
            KIND=kind, GRAD_FP32=options["grad_fp32"], AMSGRAD=options.get("amsgrad", False),
            MAXIMIZE=options["maximize"], NESTEROV=options.get("nesterov", False),
            FIRST=options.get("first_step", False), HAS_MUL=grad_mul is not None,
            CLAMPED=options.get("clamped", False), HAS_FOUND=found is not None,
            HAS_MOMENTUM=options.get("momentum", 0.0) != 0, PRECISE=config.precise,
            BLOCK=config.block, CHUNK=config.chunk, SGD_KIND=SGD, ADAMW_KIND=ADAMW, **_AT,
            num_warps=config.warps,
        )  # fmt: skip

    def _options(self, options: dict[str, Any], device: torch.device) -> Tensor:
        values = [float(options.get(name, 0.0)) for name in FLOAT_OPTIONS]  # the kernel's option vector, in order
        if self._option_values is None or self._option_values[0] != values:
            self._option_values = (values, to_device(torch.tensor(values, dtype=torch.float64), device))
        return self._option_values[1]


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device`` without waiting for the device (pinned memory, asynchronous copy)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _bias_scalars(steps: list[Tensor], options: dict[str, Any], device: torch.device) -> Tensor:
    """Per tensor ``(step_size, sqrt(bias_correction2))`` as torch's CUDA kernel forms them from the step count (fp32,
    from fp64 arithmetic of the double-precision options), then the same two in fp64 (the precise variant's), as an
    fp64 ``(tensors, 4)`` table on the device (no host synchronisation)."""
    step = torch.stack(steps).to(device, torch.float64)
    bias_correction1 = 1 - torch.pow(options["beta1"], step)
    bias_correction2 = 1 - torch.pow(options["beta2"], step)
    step_size = (options["lr"] / bias_correction1.float().double()).float().double()
    bias_correction2_sqrt = bias_correction2.float().sqrt().double()
    precise = [options["lr"] / bias_correction1, bias_correction2.sqrt()]
    return torch.stack([step_size, bias_correction2_sqrt, *precise], dim=1).contiguous()
