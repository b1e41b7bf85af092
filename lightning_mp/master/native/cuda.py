"""The one-pass lean update on CUDA: one Triton kernel per param group and step (Triton ships with CUDA builds of
torch; without it, the chunked path runs, after one warning).

Each program of the kernel updates ``BLOCK`` elements of one tensor: it joins the bf16 weights and int16 remainders
into fp32, applies the optimizer's arithmetic and splits the result back, reading and writing each byte once. Which
tensor and where: a table of ``(tensor, start)`` per program, built once per set of tensor sizes; the tensors'
addresses: a small int64 table, copied to the device (pinned, asynchronously) only when an address changed.

Arithmetic: that of torch's CUDA fused kernels (``fused_adam_utils.cuh``, ``fused_sgd_kernel.cu``): values in
fp32, the terms torch computes with the optimizer's double-precision options in fp64, bias corrections per tensor
from its step count on the device (no host synchronisation). The generated code may contract multiply-adds where
nvcc did not (or the reverse), so results can differ from ``torch.optim.AdamW(fused=True)`` in the last bit of an
element per step; tests/test_onepass.py bounds that difference on a GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

BLOCK = 1024
ADAM, ADAMW, SGD = 0, 1, 2
_kernels: dict[str, Any] = {}


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
        HAS_FOUND: tl.constexpr, HAS_MOMENTUM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        lr = tl.load(option_values)  # fp64, as torch's kernels take the optimizer's options
        beta1 = tl.load(option_values + 1)
        beta2 = tl.load(option_values + 2)
        weight_decay = tl.load(option_values + 3)
        eps = tl.load(option_values + 4)
        momentum = tl.load(option_values + 5)
        dampening = tl.load(option_values + 6)
        clamp = tl.load(option_values + 7).to(tl.float32)
        t = tl.load(block_tensor + pid).to(tl.int64)
        start = tl.load(block_start + pid)
        row = table + t * 7
        high_ptr = tl.load(row).to(tl.pointer_type(tl.int16))
        low_ptr = tl.load(row + 1).to(tl.pointer_type(tl.int16))
        n = tl.load(row + 6)
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        if HAS_FOUND:
            mask = mask & (tl.load(found) == 0)
        high = tl.load(high_ptr + offsets, mask=mask, other=0).to(tl.int32)
        low = tl.load(low_ptr + offsets, mask=mask, other=0).to(tl.int32)
        w = ((high << 16) + low).to(tl.float32, bitcast=True)
        if GRAD_FP32:
            g = tl.load(tl.load(row + 2).to(tl.pointer_type(tl.float32)) + offsets, mask=mask, other=0.0)
        else:
            g = tl.load(tl.load(row + 2).to(tl.pointer_type(tl.bfloat16)) + offsets, mask=mask, other=0.0)
            g = g.to(tl.float32)
        if HAS_MUL:
            g = g * tl.load(grad_mul)
        if CLAMPED:
            g = tl.where(g < -clamp, -clamp, g)
            g = tl.where(g > clamp, clamp, g)
        if MAXIMIZE:
            g = -g
        s1_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        if KIND == 2:  # SGD
            if weight_decay != 0:
                g = (g.to(tl.float64) + weight_decay * w.to(tl.float64)).to(tl.float32)
            if HAS_MOMENTUM:
                if FIRST:
                    buf = g
                else:
                    buf = tl.load(s1_ptr + offsets, mask=mask, other=0.0)
                    buf = (momentum * buf.to(tl.float64) + (1 - dampening) * g.to(tl.float64)).to(tl.float32)
                tl.store(s1_ptr + offsets, buf, mask=mask)
                if NESTEROV:
                    g = (g.to(tl.float64) + momentum * buf.to(tl.float64)).to(tl.float32)
                else:
                    g = buf
            w = (w.to(tl.float64) - lr * g.to(tl.float64)).to(tl.float32)
        else:
            s2_ptr = tl.load(row + 4).to(tl.pointer_type(tl.float32))
            if weight_decay != 0:
                if KIND == 1:  # AdamW: param -= lr * weight_decay * param
                    w = (w.to(tl.float64) - lr * weight_decay * w.to(tl.float64)).to(tl.float32)
                else:
                    g = (g.to(tl.float64) + w.to(tl.float64) * weight_decay).to(tl.float32)
            m = tl.load(s1_ptr + offsets, mask=mask, other=0.0)
            v = tl.load(s2_ptr + offsets, mask=mask, other=0.0)
            g64 = g.to(tl.float64)
            m = (beta1 * m.to(tl.float64) + (1 - beta1) * g64).to(tl.float32)
            v = (beta2 * v.to(tl.float64) + (1 - beta2) * g64 * g64).to(tl.float32)
            tl.store(s1_ptr + offsets, m, mask=mask)
            tl.store(s2_ptr + offsets, v, mask=mask)
            step_size = tl.load(scalars + t * 2)
            bc2_sqrt = tl.load(scalars + t * 2 + 1)
            if AMSGRAD:
                s3_ptr = tl.load(row + 5).to(tl.pointer_type(tl.float32))
                vmax = tl.maximum(tl.load(s3_ptr + offsets, mask=mask, other=0.0), v)
                tl.store(s3_ptr + offsets, vmax, mask=mask)
                v = vmax
            denom = ((tl.sqrt_rn(v) / bc2_sqrt).to(tl.float64) + eps).to(tl.float32)
            w = w - step_size * m / denom
        bits = w.to(tl.int32, bitcast=True)
        rounded = (bits + 0x8000) >> 16
        rounded = tl.where(w != w, (bits >> 16) | 0x0040, rounded)
        tl.store(high_ptr + offsets, rounded.to(tl.int16), mask=mask)
        tl.store(low_ptr + offsets, bits.to(tl.int16), mask=mask)

    _kernels["adam"] = lean_update_kernel
    return lean_update_kernel


class CudaLeanUpdate:
    """The per-group caches of the CUDA one-pass update: the program table per set of sizes, the address table."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[Any, ...], tuple[Tensor, Tensor]] = {}
        self._tables: dict[int, tuple[list[int], Tensor]] = {}
        self._option_values: Optional[tuple[list[float], Tensor]] = None  # the last options, on the device

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
        """Update the tensors of ``rows`` (``[high, low, grad, state1, state2, state3, numel]`` addresses each)."""
        numels = tuple(row[6] for row in rows)
        if numels not in self._blocks:
            tensors, starts = [], []
            for index, numel in enumerate(numels):
                for start in range(0, numel, BLOCK):
                    tensors.append(index)
                    starts.append(start)
            self._blocks[numels] = (
                torch.tensor(tensors, dtype=torch.int32, device=device),
                torch.tensor(starts, dtype=torch.int64, device=device),
            )
        block_tensor, block_start = self._blocks[numels]
        flat = [value for row in rows for value in row]
        cached = self._tables.get(key)
        if cached is None or cached[0] != flat:
            self._tables[key] = cached = (flat, _to_device(torch.tensor(flat, dtype=torch.int64), device))
        scalars = _bias_scalars(steps, options, device) if steps is not None else block_start
        kind = options["kind"]
        _kernel()[(block_tensor.numel(),)](
            cached[1], block_tensor, block_start, scalars,
            found if found is not None else block_start, grad_mul if grad_mul is not None else block_start,
            self._options(options, device),
            KIND=kind, GRAD_FP32=options["grad_fp32"], AMSGRAD=options.get("amsgrad", False),
            MAXIMIZE=options["maximize"], NESTEROV=options.get("nesterov", False),
            FIRST=options.get("first_step", False), HAS_MUL=grad_mul is not None,
            CLAMPED=options.get("clamped", False), HAS_FOUND=found is not None,
            HAS_MOMENTUM=options.get("momentum", 0.0) != 0, BLOCK=BLOCK,
        )  # fmt: skip

    def _options(self, options: dict[str, Any], device: torch.device) -> Tensor:
        names = ("lr", "beta1", "beta2", "weight_decay", "eps", "momentum", "dampening", "clamp")
        values = [float(options.get(name, 0.0)) for name in names]
        if self._option_values is None or self._option_values[0] != values:
            self._option_values = (values, _to_device(torch.tensor(values, dtype=torch.float64), device))
        return self._option_values[1]


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` on ``device`` without waiting for the device (pinned memory, asynchronous copy)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _bias_scalars(steps: list[Tensor], options: dict[str, Any], device: torch.device) -> Tensor:
    """Per tensor ``(step_size, sqrt(bias_correction2))`` in fp32, as torch's CUDA kernel forms them from the step
    count (the double-precision options' arithmetic in fp64), on the device."""
    step = torch.stack(steps).to(device, torch.float64)
    bias_correction1 = (1 - torch.pow(options["beta1"], step)).float()
    step_size = (options["lr"] / bias_correction1.double()).float()
    bias_correction2_sqrt = (1 - torch.pow(options["beta2"], step)).float().sqrt()
    return torch.stack([step_size, bias_correction2_sqrt], dim=1).contiguous()
