"""The lean update's contract on every device, and the float64 evaluation it is measured against.

The one-pass update (:mod:`lightning_mp.master.lean.plan`) promises, on any device and whatever its compiler does:

(a) the store is lossless: ``join(split(x)) == x`` bit for bit for every fp32 pattern, inf and NaN included
    (``tests/test_onepass.py`` checks every pattern class on each path);
(b) each value it writes (weight and optimizer state) is within ``k`` units in the last place of a float64
    evaluation of the optimizer's formula from the same fp32 inputs, where ``k`` is at most what torch's own fused
    kernel on the same device shows against the same evaluation (never below 1 ulp: a correctly rounded result is
    up to 0.5 ulp away, and fp64 intermediates contracted differently may land on the other neighbour);
(c) on the CPU the result is, in addition, bitwise ``torch.optim.AdamW/Adam/SGD(fused=True)``.

:func:`measure` makes one step of both kernels from the same random fp32 values and returns their distances, so the
same code states the bound in the tests (CPU, Triton's interpreter) and records it on a GPU
(``benchmarks/kernel_contract.py``).

Units in the last place: the distance divided by the fp32 spacing at the larger of the value's magnitude before the
step and the float64 result's, so that an update cancelling a value to near zero is judged at the scale of its
operands (a kernel cannot be asked for more than its inputs' precision).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

#: the optimizer configurations the contract is measured on (each flag of the kernels at least once)
ADAM_CASES: list[dict[str, Any]] = [
    dict(decoupled=True, weight_decay=0.01),
    dict(decoupled=True, weight_decay=0.0, amsgrad=True),
    dict(decoupled=False, weight_decay=0.1, maximize=True),
    dict(decoupled=False, weight_decay=0.0, betas=(0.3, 0.99)),
    dict(decoupled=True, weight_decay=0.05, amsgrad=True, maximize=True, betas=(0.2, 0.9)),
]
SGD_CASES: list[dict[str, Any]] = [
    dict(momentum=0.9, nesterov=True, weight_decay=1e-3),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(momentum=0.0, weight_decay=0.0, maximize=True),
    dict(momentum=0.5, weight_decay=0.0),
    dict(momentum=0.9, dampening=0.5, weight_decay=0.0, first_step=True),
]
CASES: list[tuple[str, dict[str, Any]]] = [("adam", c) for c in ADAM_CASES] + [("sgd", c) for c in SGD_CASES]
LR = 1e-2
EPS = 1e-8
STEP = 3


def case_name(kind: str, flags: dict[str, Any]) -> str:
    """A short readable name of one configuration (``adamw wd=0.01 amsgrad``)."""
    if kind == "adam":
        name = "adamw" if flags["decoupled"] else "adam"
    else:
        name = "sgd"
    parts = [name] + [f"{k}={v}" for k, v in flags.items() if k != "decoupled" and v not in (False, True)]
    return " ".join(parts + [k for k, v in flags.items() if v is True and k != "decoupled"])


def float64_step(
    kind: str, flags: dict[str, Any], weights: list[Tensor], grads: list[Tensor], states: list[list[Tensor]]
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """One step of the optimizer's formula in float64 from fp32 ``weights``, ``grads`` and ``states`` (Adam:
    ``[exp_avg, exp_avg_sq, max_exp_avg_sq]``; SGD: ``[momentum_buffer]``), step count :data:`STEP` (Adam); returns
    the new weights and states in float64."""
    new_w: list[Tensor] = []
    new_states: list[list[Tensor]] = [[] for _ in states]
    for i, (w, g) in enumerate(zip(weights, grads)):
        w, g = w.double(), g.double()
        if flags.get("maximize", False):
            g = -g
        s = [state[i].double() for state in states]
        if kind == "sgd":
            wd, momentum = flags["weight_decay"], flags["momentum"]
            dampening = flags.get("dampening", 0.0)
            if wd:
                g = g + wd * w
            if momentum:
                buf = g if flags.get("first_step", False) else momentum * s[0] + (1 - dampening) * g
                new_states[0].append(buf)
                g = g + momentum * buf if flags.get("nesterov", False) else buf
            w = w - LR * g
        else:
            beta1, beta2 = flags.get("betas", (0.9, 0.999))
            wd = flags["weight_decay"]
            if wd and flags["decoupled"]:
                w = w * (1 - LR * wd)
            elif wd:
                g = g + wd * w
            m = beta1 * s[0] + (1 - beta1) * g
            v = beta2 * s[1] + (1 - beta2) * g * g
            new_states[0].append(m)
            new_states[1].append(v)
            if flags.get("amsgrad", False):
                v = torch.maximum(s[2], v)
                new_states[2].append(v)
            bias1, bias2 = 1 - beta1**STEP, 1 - beta2**STEP
            w = w - (LR / bias1) * m / (v.sqrt() / bias2**0.5 + EPS)
        new_w.append(w)
    return new_w, [s for s in new_states if s]


def ulps(values: Tensor, reference: Tensor, before: Tensor) -> float:
    """The largest distance of fp32 ``values`` from float64 ``reference``, in fp32 units in the last place at the
    larger of ``|before|`` and ``|reference|`` (module doc)."""
    values, reference, before = values.double().cpu(), reference.double().cpu(), before.double().cpu()
    scale = torch.maximum(before.abs(), reference.abs()).clamp_min(torch.finfo(torch.float32).tiny)
    spacing = torch.pow(2.0, torch.floor(torch.log2(scale)) - 23)
    return ((values - reference).abs() / spacing).max().item()


def random_inputs(
    kind: str, flags: dict[str, Any], sizes: list[int], grad_dtype: torch.dtype, seed: int
) -> tuple[list[Tensor], list[Tensor], list[list[Tensor]]]:
    """fp32 weights, gradients (rounded to ``grad_dtype``, then fp32) and optimizer states for one step, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, generator=generator) * 0.05 for n in sizes]
    grads = [(torch.randn(n, generator=generator) * 1e-2).to(grad_dtype).float() for n in sizes]
    if kind == "sgd":
        states = [[torch.randn(n, generator=generator) * 1e-2 for n in sizes]] if flags["momentum"] else []
    else:
        count = 3 if flags.get("amsgrad", False) else 2
        states = [[torch.randn(n, generator=generator) * 1e-3 for n in sizes]]
        states += [[torch.rand(n, generator=generator) * 1e-4 for n in sizes] for _ in range(count - 1)]
    return weights, grads, states


def torch_step(
    kind: str, flags: dict[str, Any], weights: list[Tensor], grads: list[Tensor], states: list[list[Tensor]]
) -> None:
    """torch's fused kernel (the tensors' device's) on fp32 ``weights`` and ``states``, in place."""
    if kind == "sgd":
        momentum = flags["momentum"]
        torch._fused_sgd_(
            weights, grads, states[0] if momentum else [], weight_decay=flags["weight_decay"], momentum=momentum,
            lr=LR, dampening=flags.get("dampening", 0.0), nesterov=flags.get("nesterov", False),
            maximize=flags.get("maximize", False), is_first_step=flags.get("first_step", False), grad_scale=None,
            found_inf=None,
        )  # fmt: skip
        return
    betas = flags.get("betas", (0.9, 0.999))
    amsgrad = flags.get("amsgrad", False)
    kernel = torch._fused_adamw_ if flags["decoupled"] else torch._fused_adam_
    steps = [torch.tensor(float(STEP), device=weights[0].device) for _ in weights]
    kernel(
        weights, grads, states[0], states[1], states[2] if amsgrad else [], steps, amsgrad=amsgrad, lr=LR,
        beta1=betas[0], beta2=betas[1], weight_decay=flags["weight_decay"], eps=EPS,
        maximize=flags.get("maximize", False), grad_scale=None, found_inf=None,
    )  # fmt: skip


def lean_step(
    kind: str,
    flags: dict[str, Any],
    weights: list[Tensor],
    grads: list[Tensor],
    states: list[list[Tensor]],
    grad_dtype: torch.dtype,
    device: torch.device,
    path: str,
) -> list[Tensor]:
    """Our one-pass kernel on lean copies of ``weights`` (split into bf16 + remainder on ``device``) and on
    ``states`` in place; ``path``: ``"cpu"`` (the C kernel) or ``"triton"`` (the CUDA kernel; on a CPU device under
    ``TRITON_INTERPRET=1``). Returns the joined fp32 weights."""
    from lightning_mp.kernels import native
    from lightning_mp.kernels.bits import join_fp32, split_fp32

    halves = [tuple(t.to(device) for t in split_fp32(w)) for w in weights]
    local_grads = [g.to(device, grad_dtype).contiguous() for g in grads]
    options: dict[str, Any] = dict(maximize=flags.get("maximize", False), lr=LR, grad_fp32=grad_dtype == torch.float32)
    if kind == "sgd":
        options.update(kind=native.SGD, weight_decay=flags["weight_decay"], momentum=flags["momentum"],
                       dampening=flags.get("dampening", 0.0), nesterov=flags.get("nesterov", False),
                       first_step=flags.get("first_step", False))  # fmt: skip
        steps: Optional[list[Tensor]] = None
    else:
        betas = flags.get("betas", (0.9, 0.999))
        options.update(kind=native.ADAMW if flags["decoupled"] else native.ADAM, amsgrad=flags.get("amsgrad", False),
                       beta1=betas[0], beta2=betas[1], weight_decay=flags["weight_decay"], eps=EPS)  # fmt: skip
        steps = [torch.tensor(float(STEP - 1), device=device) for _ in weights]
        torch._foreach_add_(steps, 1)
    rows = []
    for i, ((high, low), grad) in enumerate(zip(halves, local_grads)):
        pointers = [state[i].data_ptr() for state in states] + [0] * (3 - len(states))
        rows.append([high.data_ptr(), low.data_ptr(), grad.data_ptr(), *pointers, weights[i].numel()])
    options["clamped"], options["clamp"] = False, -1.0
    if path == "cpu":
        if native.cpu_kernel() is None:
            raise RuntimeError("the C kernel cannot be built here (no C compiler)")
        native.run_rows(rows, steps, options, None, None)
    else:
        from lightning_mp.kernels.cuda import CudaLeanUpdate

        CudaLeanUpdate().run(0, rows, steps, options, None, None, device)
    return [join_fp32(high, low) for high, low in halves]


def measure(
    kind: str,
    flags: dict[str, Any],
    device: torch.device,
    path: str,
    grad_dtype: torch.dtype = torch.bfloat16,
    sizes: tuple[int, ...] = (4096, 7, 3001),
    seeds: int = 3,
) -> dict[str, float]:
    """One step from the same random fp32 values by torch's fused kernel on ``device`` and by ours (``path``: see
    :func:`lean_step`), each compared with :func:`float64_step`: ``{"torch": ulps, "ours": ulps, "differ": fraction
    of values whose bits differ between the two}``."""
    worst = {"torch": 0.0, "ours": 0.0, "differ": 0.0}
    total = differing = 0
    for seed in range(seeds):
        weights, grads, states = random_inputs(kind, flags, list(sizes), grad_dtype, seed)
        ref_w, ref_states = float64_step(kind, flags, weights, grads, states)
        theirs_w = [w.to(device, copy=True) for w in weights]
        theirs_states = [[t.to(device, copy=True) for t in s] for s in states]
        torch_step(kind, flags, theirs_w, [g.to(device) for g in grads], theirs_states)
        ours_states = [[t.to(device, copy=True) for t in s] for s in states]
        ours_w = lean_step(kind, flags, weights, grads, ours_states, grad_dtype, device, path)
        pairs = list(zip(weights, ref_w, theirs_w, ours_w))
        for k, state in enumerate(states):
            pairs += list(zip(state, ref_states[k], theirs_states[k], ours_states[k]))
        for before, ref, theirs, ours in pairs:
            worst["torch"] = max(worst["torch"], ulps(theirs, ref, before))
            worst["ours"] = max(worst["ours"], ulps(ours, ref, before))
            differing += int((theirs.cpu().view(torch.int32) != ours.cpu().view(torch.int32)).sum())
            total += before.numel()
    worst["differ"] = differing / total
    return worst


def bound(torch_ulps: float) -> float:
    """The contract's ``k`` for a configuration where torch's fused kernel is ``torch_ulps`` from float64."""
    return max(torch_ulps, 1.0)
