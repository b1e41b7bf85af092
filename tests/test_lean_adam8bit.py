"""The one-pass 8-bit Adam/AdamW update of lean masters (lightning_mp.kernels.adam8bit, lean_adam8bit.c):

- (a) bitwise torchao's own ``AdamW8bit`` / ``Adam8bit`` (its compiled step) on the fp32 masters the bf16 weights and
  remainders join to: weights, codes, scales, fp32 moments and step counts, over several steps; and the state stays
  torchao's (steps of either, and a ``state_dict`` round trip, interleave);
- (b) against a float64 evaluation of the same quantized update rounded once: the measured gap (1 ulp weights, codes
  one apart only at a decision midpoint);
- (c) a set ``found_inf`` changes nothing; step counters; lists of pieces; refusals (``amsgrad``, bad tensors);
- (d) the kernel's code search (a table per map) against the reference binary search and torchao's
  ``quantize_8bit_with_qmap`` on millions of values and every edge (zero codes differ), maps it falls back for; the
  tables' cache: maps edited in place, more maps than it holds, concurrent calls; late steps (bc1 == 1).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mp.kernels import adam8bit, native
from lightning_mp.kernels.bits import join_fp32, split_fp32

torchao_optim = pytest.importorskip("torchao.optim")
from torchao.optim.quant_utils import quantize_8bit_with_qmap  # noqa: E402
from torchao.optim.subclass_8bit import OptimState8bit  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if adam8bit.cpu_kernel() is None:
        pytest.skip("the 8-bit one-pass kernel is not built here (no C compiler, or LIGHTNING_MP_NATIVE=0)")


def _zeros_state(shape, signed, block_size=256):
    """torchao's fresh state of an fp32 parameter of ``shape`` (``_AdamBase._new_buffer``)."""
    numel = math.prod(shape)
    if numel >= 4096 and numel % block_size == 0:
        return OptimState8bit.zeros(shape, signed, block_size, torch.device("cpu"), dtype=torch.float32)
    return torch.zeros(shape)


def _clone(moment):
    if isinstance(moment, OptimState8bit):
        return OptimState8bit(moment.codes.clone(), moment.scale.clone(), moment.qmap.clone(), moment.signed)
    return moment.clone()


def _lean(shape, generator, spread=0.05):
    high, low = split_fp32(torch.randn(shape, generator=generator) * spread)
    return high, low


def _differences(ours, theirs) -> dict[str, int]:
    """How many weights (bit patterns), codes, scales (bit patterns) of ``ours`` differ from ``theirs``."""
    if isinstance(theirs, OptimState8bit):
        return {
            "codes": int((ours.codes != theirs.codes).sum()),
            "scales": int((ours.scale.view(torch.int32) != theirs.scale.view(torch.int32)).sum()),
        }
    return {"values": int((ours.view(torch.int32) != theirs.view(torch.int32)).sum())}


# ---------------------------------------------------------------------- (a) bitwise torchao's own step
# (optimizer, shape, its options, gradient dtype, grad factor, clip-by-value bound); one torch.compile of torchao's
# step each
TORCHAO_CASES = [
    ("AdamW8bit", (4096,), {}, torch.bfloat16, None, None),
    ("AdamW8bit", (64, 80), {"weight_decay": 0.0}, torch.float32, 0.5, 0.002),  # unscale factor, clip, no decay
    ("Adam8bit", (40, 128), {"weight_decay": 0.1, "betas": (0.3, 0.4)}, torch.bfloat16, None, None),  # lerp's other
    ("AdamW8bit", (8192,), {"block_size": 2048}, torch.bfloat16, 2.0**-10, None),  # blocks of two passes
    ("AdamW8bit", (30, 10), {"weight_decay": 0.05}, torch.bfloat16, None, 0.01),  # < 4096: fp32 moments; clipped
]


@pytest.mark.parametrize("case", TORCHAO_CASES, ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[2]}")
def test_bitwise_torchao(case, monkeypatch):
    name, shape, options, grad_dtype, factor, clamp = case
    monkeypatch.setattr(adam8bit, "GRAIN", 1024)  # several units (threads) even on these small tensors
    generator = torch.Generator().manual_seed(1)
    high, low = _lean(shape, generator)
    master = torch.nn.Parameter(join_fp32(high, low).clone())
    optimizer = getattr(torchao_optim, name)([master], lr=1e-2, **options)
    block = options.get("block_size", 256)
    exp_avg, exp_avg_sq = _zeros_state(shape, True, block), _zeros_state(shape, False, block)
    step = torch.tensor(0.0)
    group = optimizer.param_groups[0]
    mul = torch.tensor(factor, dtype=torch.float32) if factor is not None else None
    for k in range(4):
        group["lr"].fill_(1e-2 * (0.5 + k))  # an lr schedule: torchao's lr tensor, read by both
        grad = (torch.randn(shape, generator=generator) * 10.0 ** -(k % 3 + 1)).to(grad_dtype)
        master.grad = grad.float() * mul if mul is not None else grad.float()  # as the chunked path's grad.mul_
        if clamp is not None:  # then clip_grad_value_ (torch's clamp_min_, clamp_max_ in fp32)
            master.grad.clamp_min_(-clamp).clamp_max_(clamp)
        optimizer.step()
        adam8bit.adam8bit_step(
            high, low, grad, exp_avg, exp_avg_sq, step, lr=group["lr"], beta1=group["betas"][0],
            beta2=group["betas"][1], eps=group["eps"], weight_decay=group["weight_decay"],
            adamw=name.startswith("AdamW"), grad_mul=mul, clamp=clamp,
        )  # fmt: skip
        state = optimizer.state[master]
        assert isinstance(state["exp_avg"], OptimState8bit) == (math.prod(shape) >= 4096)
        weights = int((join_fp32(high, low).view(torch.int32) != master.detach().view(torch.int32)).sum())
        gaps = {"weights": weights, **{f"m {k}": v for k, v in _differences(exp_avg, state["exp_avg"]).items()}}
        gaps.update({f"v {k}": v for k, v in _differences(exp_avg_sq, state["exp_avg_sq"]).items()})
        assert set(gaps.values()) == {0}, (k, gaps)
        assert step.item() == state["step"].item() == k + 1


def test_special_values_bitwise_torchao():
    """Zeros, a signed zero, a subnormal, values near fp32's largest, a block without gradient (frozen rows), and an
    overflowing square (an inf second moment, then NaN blocks), NaN and inf gradients: torchao's bits still, NaN
    scales included (at::vec's all-ones NaN)."""
    generator = torch.Generator().manual_seed(13)
    n = 4096
    weight = torch.randn(n, generator=generator) * 0.05
    weight[:256] = 0.0
    weight[300], weight[301], weight[302] = -0.0, 1e-40, 3e38
    high, low = split_fp32(weight)
    master = torch.nn.Parameter(join_fp32(high, low).clone())
    optimizer = torchao_optim.AdamW8bit([master], lr=1e-2)
    exp_avg, exp_avg_sq, step = _zeros_state((n,), True), _zeros_state((n,), False), torch.tensor(0.0)
    for k in range(3):
        grad = (torch.randn(n, generator=generator) * 1e-2).bfloat16()
        grad[:256] = 0.0
        grad[600], grad[601] = 1e-38, -3e38 if k == 0 else 0.0
        if k == 2:
            grad[1000], grad[1300] = float("nan"), float("inf")
        master.grad = grad.float()
        optimizer.step()
        adam8bit.adam8bit_step(high, low, grad, exp_avg, exp_avg_sq, step, lr=optimizer.param_groups[0]["lr"])
        assert torch.equal(join_fp32(high, low).view(torch.int32), master.detach().view(torch.int32))
        state = optimizer.state[master]
        assert (
            _differences(exp_avg, state["exp_avg"])
            == _differences(exp_avg_sq, state["exp_avg_sq"])
            == {"codes": 0, "scales": 0}
        )
    assert join_fp32(high, low).isnan().sum() > 256  # the NaN blocks were reached


def test_fp32_parameter_bitwise_torchao():
    """A parameter kept in fp32 (``low=None``): updated in place, torchao's bits."""
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(4096, generator=generator) * 0.05
    master = torch.nn.Parameter(weight.clone())
    optimizer = torchao_optim.AdamW8bit([master], lr=3e-3)
    exp_avg, exp_avg_sq, step = _zeros_state((4096,), True), _zeros_state((4096,), False), torch.tensor(0.0)
    for _ in range(2):
        grad = torch.randn(4096, generator=generator) * 1e-3
        master.grad = grad.clone()
        optimizer.step()
        adam8bit.adam8bit_step(weight, None, grad, exp_avg, exp_avg_sq, step, lr=optimizer.param_groups[0]["lr"])
    assert torch.equal(weight.view(torch.int32), master.detach().view(torch.int32))
    assert _differences(exp_avg, optimizer.state[master]["exp_avg"]) == {"codes": 0, "scales": 0}


def test_state_stays_torchaos():
    """Steps of ours on torchao's own state objects, a state_dict round trip into a new torchao optimizer, torchao's
    step, ours again: the same bits as four torchao steps."""
    generator = torch.Generator().manual_seed(3)
    high, low = _lean((4096,), generator)
    grads = [(torch.randn(4096, generator=generator) * 1e-2).bfloat16() for _ in range(4)]
    reference = torch.nn.Parameter(join_fp32(high, low).clone())
    plain = torchao_optim.AdamW8bit([reference], lr=1e-2)
    for grad in grads:
        reference.grad = grad.float()
        plain.step()

    master = torch.nn.Parameter(join_fp32(high, low).clone())
    optimizer = torchao_optim.AdamW8bit([master], lr=1e-2)
    state = optimizer.state[master]
    state.update(step=torch.tensor(0.0), exp_avg=_zeros_state((4096,), True), exp_avg_sq=_zeros_state((4096,), False))

    def ours(grad):
        adam8bit.adam8bit_step(
            high, low, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=optimizer.param_groups[0]["lr"]
        )

    ours(grads[0])
    ours(grads[1])
    saved = optimizer.state_dict()
    master = torch.nn.Parameter(join_fp32(high, low).clone())
    optimizer = torchao_optim.AdamW8bit([master], lr=1e-2)
    optimizer.load_state_dict(saved)
    master.grad = grads[2].float()
    optimizer.step()
    high, low = split_fp32(master.detach())
    state = optimizer.state[master]
    ours(grads[3])
    assert torch.equal(join_fp32(high, low).view(torch.int32), reference.detach().view(torch.int32))
    for key in ("exp_avg", "exp_avg_sq"):
        assert _differences(state[key], plain.state[reference][key]) == {"codes": 0, "scales": 0}
    assert state["step"].item() == 4


# ---------------------------------------------------------------------- (b) a float64 reference rounded once
def _powf(base: float, exponent: float) -> float:
    """The C library's ``powf`` (the function torchao's compiled step and the kernel call)."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.powf.restype, libm.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    return float(libm.powf(base, exponent))


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def step_scalars(step: float, *, lr, beta1, beta2, eps, weight_decay, adamw, exact: bool) -> dict[str, float]:
    """The per-step scalars of the update. ``exact=False``: as torchao's compiled step makes them, in fp32 (beta1,
    beta2, eps, weight decay rounded to fp32; the lerp weights ``1 - beta`` rounded from the double; the bias
    corrections ``1 - powf(beta, step)``, ``sqrtf`` of the second, and ``lr * wd`` in fp32). ``exact=True``: the
    textbook values in float64 from the same hyperparameters (lr still torchao's fp32 lr tensor)."""
    lr = _f32(lr)
    if exact:
        return dict(lr=lr, t1=1 - beta1, t2=1 - beta2, bias1=1 - beta1**step, bias2_sqrt=math.sqrt(1 - beta2**step),
                    eps=eps, decay=lr * weight_decay if adamw else weight_decay)  # fmt: skip
    t1, t2 = 1 - beta1, 1 - beta2
    t1 = 1 + _f32(t1 - 1) if abs(t1) >= 0.5 else _f32(t1)  # inductor's lerp: b + (b - a) * (t - 1) for |t| >= 0.5
    t2 = 1 + _f32(t2 - 1) if abs(t2) >= 0.5 else _f32(t2)
    return dict(
        lr=lr, t1=t1, t2=t2, bias1=_f32(1 - _powf(_f32(beta1), step)),
        bias2_sqrt=_f32(math.sqrt(_f32(1 - _powf(_f32(beta2), step)))), eps=_f32(eps),
        decay=_f32(lr * _f32(weight_decay)) if adamw else _f32(weight_decay),
    )  # fmt: skip


U = 2.0**-24  # fp32's unit roundoff


def float64_step(weight, grad, exp_avg, exp_avg_sq, scalars, *, adamw, factor):
    """One step of the same quantized update, every elementwise operation in float64, from the same fp32 weights,
    gradients, 8-bit states and ``scalars`` (:func:`step_scalars`). Returns the new weights in float64 (rounded once:
    ``.float()``) and a bound on an fp32 evaluation's distance from them (below), and per moment its float64 values
    divided by their float64 scales, the scales, the codes torchao's rule picks for those values, and bounds on the
    fp32 scales' and scaled values' distances.

    The bounds are the forward error of the fp32 operations in the kernel's (and torchao's) order, each rounding at
    most U relative (no fused multiply-add): the gradient's factor and weight decay, the moments' dequantization
    (``map[code] * scale``, rounded to fp32), the two lerps (which cancel when
    the moment and the gradient have opposite signs), the square root and the divisions, the final subtraction. The
    weights' bound is at least their own rounding (U |w|) and grows with the update's size times its inputs' relative
    errors: where the moment nearly cancels, an fp32 step is many ulps from the float64 one (torchao's as well)."""
    k = scalars
    w, g = weight.double(), grad.double()
    g_error = torch.zeros_like(g)
    if factor is not None:
        g = g * _f32(factor)
        g_error = U * g.abs()
    w_error = torch.zeros_like(w)
    if adamw:
        w_error = 2 * U * w.abs()
        w = w - k["decay"] * w
    else:
        g_error = g_error + 2 * U * (g.abs() + (k["decay"] * w).abs())
        g = g + k["decay"] * w
    before = []
    for state in (exp_avg, exp_avg_sq):
        values = state.qmap.double()[state.codes.long()].view(-1, state.block_size) * state.scale.double()[:, None]
        before.append(values.view(-1))
    m = (1 - k["t1"]) * before[0] + k["t1"] * g
    m_error = 4 * U * (before[0].abs() + g.abs()) + 2 * g_error  # the fp32 dequantization's rounding, the lerp's
    g2 = g * g
    v = (1 - k["t2"]) * before[1] + k["t2"] * g2
    v_error = 4 * U * (before[1] + g2) + 2 * (U * g2 + 2 * g.abs() * g_error)
    root = v.sqrt()
    den = root / k["bias2_sqrt"] + k["eps"]
    root_error = torch.minimum(v_error / (2 * root).clamp_min(1e-300), v_error.sqrt())
    den_error = root_error / k["bias2_sqrt"] + 3 * U * den
    update = k["lr"] * (m / k["bias1"]) / den
    update_error = update.abs() * (den_error / den + 4 * U) + k["lr"] / k["bias1"] * m_error / den
    w = w - update
    bound = w_error + update_error + U * w.abs()
    moments = []
    for values, error, state in ((m, m_error, exp_avg), (v, v_error, exp_avg_sq)):
        blocks, errors = values.view(-1, state.block_size), error.view(-1, state.block_size)
        scale = blocks.abs().amax(-1).clip(1e-12)
        scale_bound = errors.amax(-1)  # a maximum moves by at most the largest error of the values
        scaled = (blocks / scale[:, None]).view(-1)
        scaled_bound = ((errors + blocks.abs() * scale_bound[:, None] / scale[:, None]) / scale[:, None]).view(-1)
        scaled_bound = scaled_bound + 3 * U * scaled.abs()  # the division and quantize's `x - map[code]`
        codes = quantize_8bit_with_qmap(scaled, state.qmap.double())
        moments.append((scaled, scaled_bound, scale, scale_bound, codes))
    return w, bound, moments


def measure_gap(seed: int, adamw: bool, weight_decay: float, betas, factor, steps: int = 3, exact=False, first=1):
    """Steps the kernel from random lean weights and 8-bit states (step counts ``first`` on) and compares each step
    with :func:`float64_step` from the same inputs. The largest over the steps of: each weight's distance as a
    fraction of its bound (``weight/bound``), how many weights differ from the once-rounded value; the same for the
    scales; codes: how many differ, by how much, and the largest distance of the float64 value from the midpoint
    where they differ, as a fraction of its bound. ``exact``: the textbook scalars (:func:`step_scalars`)."""
    generator = torch.Generator().manual_seed(seed)
    n, block = 4096, 256
    high, low = _lean((n,), generator)
    exp_avg, exp_avg_sq = _zeros_state((n,), True), _zeros_state((n,), False)
    for state, size in ((exp_avg, 1e-3), (exp_avg_sq, 1e-5)):  # a state of earlier steps: random codes and scales
        state.codes.copy_(torch.randint(0, 256, (n,), generator=generator, dtype=torch.uint8))
        state.scale.copy_(size * (0.5 + torch.rand(n // block, generator=generator)))
    step = torch.tensor(float(first - 1))
    options = dict(lr=1e-2, beta1=betas[0], beta2=betas[1], eps=1e-8, weight_decay=weight_decay, adamw=adamw)
    mul = torch.tensor(factor, dtype=torch.float32) if factor is not None else None
    keys = ["weight/bound", "weights off", "scale/bound", "scales off", "codes off", "code distance", "midpoint/bound"]
    gaps: dict[str, float] = dict.fromkeys(keys, 0)
    for _ in range(steps):
        grad = (torch.randn(n, generator=generator) * 1e-3).bfloat16()
        before = join_fp32(high, low).clone()
        scalars = step_scalars(step.item() + 1, exact=exact, **options)
        expected, bound, moments = float64_step(
            before, grad.float(), exp_avg, exp_avg_sq, scalars, adamw=adamw, factor=factor
        )
        adam8bit.adam8bit_step(high, low, grad, exp_avg, exp_avg_sq, step, grad_mul=mul, **options)
        after = join_fp32(high, low)
        gaps["weights off"] = max(gaps["weights off"], int((after != expected.float()).sum()))
        gaps["weight/bound"] = max(gaps["weight/bound"], float(((after.double() - expected).abs() / bound).max()))
        for state, (scaled, scaled_bound, scale, scale_bound, codes) in zip((exp_avg, exp_avg_sq), moments):
            gaps["scales off"] = max(gaps["scales off"], int((state.scale != scale.float()).sum()))
            distance = (state.scale.double() - scale).abs() / (scale_bound + U * scale)
            gaps["scale/bound"] = max(gaps["scale/bound"], float(distance.max()))
            differ = state.codes != codes
            gaps["codes off"] = max(gaps["codes off"], int(differ.sum()))
            if differ.any():
                gaps["code distance"] = max(
                    gaps["code distance"], int((state.codes.int() - codes.int())[differ].abs().max())
                )
                lower = torch.minimum(state.codes, codes)[differ].long()  # the midpoint between the two codes
                qmap = state.qmap.double()
                midpoint = (qmap[lower] + qmap[(lower + 1).clamp(max=255)]) / 2
                relative = (scaled[differ] - midpoint).abs() / scaled_bound[differ]
                gaps["midpoint/bound"] = max(gaps["midpoint/bound"], float(relative.max()))
    return gaps


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    adamw=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    betas=st.sampled_from([(0.9, 0.999), (0.3, 0.4), (0.5, 0.95)]),
    factor=st.sampled_from([None, 0.25, 3.0]),
    first=st.sampled_from([1, 2, 10, 1000]),
)
def test_float64_reference_gap(seed, adamw, weight_decay, betas, factor, first):
    """Against the float64 evaluation of the same update from the same fp32 per-step scalars, rounded once: each
    weight and scale within the forward error bound of the fp32 operations (:func:`float64_step`); a code differs
    from the float64 choice by one at most, and only where the float64 value is within its bound of the midpoint
    between the two map values (where the fp32 moment's last bits decide). The rounded float64 value itself is not
    reached (``weights off``): the fp32 chain rounds about ten times, and torchao's own step is the same bits."""
    gaps = measure_gap(seed, adamw, weight_decay, betas, factor, first=first)
    assert gaps["weight/bound"] <= 1.0, gaps
    assert gaps["scale/bound"] <= 1.0, gaps
    assert gaps["code distance"] <= 1, gaps
    assert gaps["midpoint/bound"] <= 1.0, gaps


# ---------------------------------------------------------------------- (c) skips, counters, pieces, refusals
def _snapshot(*tensors):
    return [t.clone() for t in tensors]


def _same_bytes(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _quantized_piece(generator, n=4096, grad_dtype=torch.bfloat16):
    high, low = _lean((n,), generator)
    grad = (torch.randn(n, generator=generator) * 1e-2).to(grad_dtype)
    exp_avg, exp_avg_sq = _zeros_state((n,), True), _zeros_state((n,), False)
    return adam8bit.Adam8bitPiece(high, low, grad, exp_avg, exp_avg_sq, torch.tensor(0.0))


def _piece_tensors(piece):
    tensors = [piece.high, piece.low, piece.step]
    for moment in (piece.exp_avg, piece.exp_avg_sq):
        tensors += [moment.codes, moment.scale, moment.qmap] if isinstance(moment, OptimState8bit) else [moment]
    return [t for t in tensors if t is not None]


def test_found_inf_changes_nothing():
    generator = torch.Generator().manual_seed(4)
    piece = _quantized_piece(generator)
    adam8bit.adam8bit_step_pieces([piece], lr=1e-2)  # a state that is not all zeros
    piece.grad[7] = float("inf")
    before = _snapshot(*_piece_tensors(piece))
    adam8bit.adam8bit_step_pieces([piece], lr=1e-2, found_inf=torch.tensor([1.0]))
    for old, new in zip(before, _piece_tensors(piece)):
        assert _same_bytes(old, new)
    piece.grad[7] = 0.0
    adam8bit.adam8bit_step_pieces([piece], lr=1e-2, found_inf=torch.tensor([0.0]))  # a clear flag: a step
    assert piece.step.item() == 2
    assert not torch.equal(before[0], piece.high) or not torch.equal(before[1], piece.low)


def test_found_clear_equals_no_flag():
    pieces = [_quantized_piece(torch.Generator().manual_seed(5)) for _ in range(2)]
    adam8bit.adam8bit_step_pieces(pieces[:1], lr=1e-2, weight_decay=0.1)
    adam8bit.adam8bit_step_pieces(pieces[1:], lr=1e-2, weight_decay=0.1, found_inf=torch.tensor(0.0))
    for a, b in zip(_piece_tensors(pieces[0]), _piece_tensors(pieces[1])):
        assert _same_bytes(a, b)


def test_step_counters_and_pieces():
    """A list of pieces is the same as one call per piece; each distinct step tensor advances once per call (a step
    shared by two pieces, the parts of one parameter, too); ``increment_step=False`` reads the counts as they are."""
    together = [_quantized_piece(torch.Generator().manual_seed(s), n) for s, n in [(6, 4096), (7, 300), (8, 8192)]]
    apart = [_quantized_piece(torch.Generator().manual_seed(s), n) for s, n in [(6, 4096), (7, 300), (8, 8192)]]
    for _ in range(3):
        adam8bit.adam8bit_step_pieces(together, lr=1e-2)
        for piece in apart:
            adam8bit.adam8bit_step_pieces([piece], lr=1e-2)
    for a, b in zip(together, apart):
        assert a.step.item() == b.step.item() == 3
        for x, y in zip(_piece_tensors(a), _piece_tensors(b)):
            assert _same_bytes(x, y)
    shared = torch.tensor(0.0)
    halves = [_quantized_piece(torch.Generator().manual_seed(9)) for _ in range(2)]
    for piece in halves:
        piece.step = shared
    adam8bit.adam8bit_step_pieces(halves, lr=1e-2)
    assert shared.item() == 1
    adam8bit.adam8bit_step_pieces(halves, lr=1e-2, increment_step=False)
    assert shared.item() == 1


def test_amsgrad_refused_as_torchao_cannot_step_it():
    piece = _quantized_piece(torch.Generator().manual_seed(10))
    with pytest.raises(NotImplementedError, match="amsgrad"):
        adam8bit.adam8bit_step_pieces([piece], lr=1e-2, amsgrad=True)
    master = torch.nn.Parameter(torch.randn(4096))
    optimizer = torchao_optim.AdamW8bit([master], amsgrad=True)
    master.grad = torch.randn(4096)
    with pytest.raises(Exception, match="maximum"):  # torchao 0.18: aten.maximum not implemented for OptimState8bit
        optimizer.step()


def test_bad_tensors_refused():
    piece = _quantized_piece(torch.Generator().manual_seed(11))
    with pytest.raises(ValueError, match="low"):
        adam8bit.adam8bit_step(piece.high, piece.low[:-1], piece.grad, piece.exp_avg, piece.exp_avg_sq, piece.step,
                               lr=1e-2)  # fmt: skip
    with pytest.raises(ValueError, match="grad"):
        adam8bit.adam8bit_step(piece.high, piece.low, piece.grad.half(), piece.exp_avg, piece.exp_avg_sq, piece.step,
                               lr=1e-2)  # fmt: skip
    with pytest.raises(ValueError, match="signed"):
        adam8bit.adam8bit_step(piece.high, piece.low, piece.grad, piece.exp_avg_sq, piece.exp_avg, piece.step,
                               lr=1e-2)  # fmt: skip
    with pytest.raises(ValueError, match="both"):
        adam8bit.adam8bit_step(piece.high, piece.low, piece.grad, piece.exp_avg, torch.zeros(4096), piece.step,
                               lr=1e-2)  # fmt: skip


def test_no_compiler_warns_once_and_refuses(monkeypatch):
    saved = dict(adam8bit._state)
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    adam8bit._reset_for_tests()
    try:
        with pytest.warns(RuntimeWarning, match="no C compiler"):
            assert adam8bit.cpu_kernel() is None
        assert adam8bit.threading_model() is None
        piece = _quantized_piece(torch.Generator().manual_seed(12))
        with pytest.raises(RuntimeError, match="not built"):
            adam8bit.adam8bit_step_pieces([piece], lr=1e-2)
    finally:
        adam8bit._state.clear()
        adam8bit._state.update(saved)


# ---------------------------------------------------------------------- (d) the code search's table, the maps' cache
def _quantize_check():
    check = adam8bit.cpu_kernel().lean_adam8bit_quantize_check
    check.restype = ctypes.c_int
    check.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return check


def _ulps(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` moved ``k`` fp32 ulps (nextafter ``|k|`` times, towards +inf for k > 0)."""
    target = torch.full_like(x, math.inf if k > 0 else -math.inf)
    for _ in range(abs(k)):
        x = torch.nextafter(x, target)
    return x


def _search_inputs(qmap: torch.Tensor, generator, sample: Optional[int] = None) -> torch.Tensor:
    """Millions of random bit patterns; every map value, the midpoints between neighbours (in fp32 and rounded from
    float64) and the largest / smallest values of fp32 and each of these up to 3 ulps apart; signed zeros, infinities,
    NaNs, subnormals, values just outside [-1, 1]; every key of the 65536-key buckets where the code steps (with
    ``sample``: of those where it steps more than once, and ``sample`` others)."""
    bits = torch.randint(-(2**31), 2**31, (1 << 22,), generator=generator, dtype=torch.int64).to(torch.int32)
    near = torch.rand(1 << 20, generator=generator) * 2 - 1  # the values m / scale takes
    mid32 = (qmap[:-1] + qmap[1:]) * 0.5
    mid64 = ((qmap[:-1].double() + qmap[1:].double()) / 2).float()
    special = [0.0, -0.0, math.inf, -math.inf, math.nan, 1.0, -1.0, 3.4028234663852886e38, -3.4028234663852886e38]
    points = torch.cat([qmap, mid32, mid64, torch.tensor(special), near[:4096]])
    spread = torch.cat([points] + [_ulps(points, k) for k in (-3, -2, -1, 1, 2, 3)])
    patterns = torch.tensor(
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA00000, 0x00000001, 0x80000001]
        + [0x007FFFFF, 0x807FFFFF, 0x00400000, 0x80400000],  # NaNs (quiet, signalling, payloads), subnormals
        dtype=torch.int64,
    ).to(torch.int32)
    subnormal = torch.randint(1, 1 << 23, (1 << 16,), generator=generator, dtype=torch.int32)
    above = torch.cat([_ulps(torch.ones(1), k) for k in range(1, 200)] + [1 + torch.rand(4096, generator=generator)])
    # the buckets (the keys' top 16 bits) of [-1.01, 1.01] where the map's code changes: all 65536 keys of each
    keys = torch.arange(-(2**31), 2**31, 1 << 16, dtype=torch.int64)  # bucket starts, as keys
    first = _from_keys(keys)
    last = _from_keys(keys + 0xFFFF)
    inside = (first.abs() <= 1.01) & (last.abs() <= 1.01)
    jump = quantize_8bit_with_qmap(last, qmap).int() - quantize_8bit_with_qmap(first, qmap).int()
    steps = keys[inside & (jump != 0)]
    if sample is not None:
        some = steps[torch.randperm(steps.numel(), generator=generator)[:sample]]
        steps = torch.cat([keys[inside & (jump.abs() > 1)], some])
    every = _from_keys((steps[:, None] + torch.arange(1 << 16)).reshape(-1))
    return torch.cat(
        [
            bits.view(torch.float32), near, spread, patterns.view(torch.float32),
            subnormal.view(torch.float32), -subnormal.view(torch.float32), above, -above, every,
        ]
    )  # fmt: skip


def _from_keys(keys: torch.Tensor) -> torch.Tensor:
    """The fp32 values of order-preserving keys (as int64, biased by -2**31): the inverse of the kernel's key_of."""
    unsigned = keys + 2**31
    bits = torch.where(unsigned >= 2**31, unsigned - 2**31, 2**32 - 1 - unsigned)
    return bits.to(torch.int64).to(torch.uint32).view(torch.int32).view(torch.float32)


def _search(qmap: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    fast, reference = torch.empty_like(x, dtype=torch.uint8), torch.empty_like(x, dtype=torch.uint8)
    x, qmap = x.contiguous(), qmap.contiguous()
    used = _quantize_check()(x.data_ptr(), x.numel(), qmap.data_ptr(), fast.data_ptr(), reference.data_ptr())
    assert used in (0, 1, 2), "the searches (bins, table for either moment of two, table for one) disagree"
    return fast, reference, used


def _has_vbmi() -> bool:
    """Whether this CPU has AVX-512 VBMI (the kernel is built for the CPU it runs on: the bins search then)."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = [line.split(":", 1)[1].split() for line in info if line.startswith("flags")]
    except OSError:
        return False
    return bool(flags) and "avx512vbmi" in flags[0] and "avx512bw" in flags[0]


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_table_search_equals_reference_search(signed):
    """The kernel's code search (a table per 65536 keys, one step at most inside each) against the reference binary
    search it is built from and against torchao's quantize_8bit_with_qmap, for torchao's maps: zero codes differ."""
    from torchao.optim.quant_utils import create_dynamic_map
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    qmap = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned(), dtype=torch.float32)
    assert torch.equal(qmap, torch.tensor(create_dynamic_map(signed), dtype=torch.float32))
    x = _search_inputs(qmap, torch.Generator().manual_seed(20 + signed))
    assert x.numel() > 8_000_000
    fast, reference, used = _search(qmap, x)
    assert used == (2 if _has_vbmi() else 1)  # the bins (or the table), not the fallback
    assert int((fast != reference).sum()) == 0
    torchao_codes = quantize_8bit_with_qmap(x, qmap)
    assert int((reference != torchao_codes).sum()) == 0


def test_table_search_other_maps():
    """Maps the table is not built for (unsorted; an infinity; a NaN) take the reference search; a sorted map with a
    value twice keeps the bins (on a CPU with AVX-512 VBMI: two thresholds at one key), one with a value ten times
    (ten thresholds at one key) or with many steps inside a bucket (those buckets are searched as the reference) the
    table: every code equal to torchao's either way."""
    from torchao.optim.subclass_8bit import get_qmap_signed

    generator = torch.Generator().manual_seed(30)
    signed = torch.tensor(get_qmap_signed(), dtype=torch.float32)
    repeated = signed.clone()
    repeated[100:110] = signed[100]
    repeated[200:202] = signed[201]
    paired = signed.clone()
    paired[200] = signed[201]  # one value twice: two thresholds at one key
    crowded = signed.clone()
    crowded[140:180] = _ulps(torch.full((1,), 0.3), 1)[0] + torch.arange(40) * 2.0**-25  # 40 values 1 ulp apart
    crowded, _ = crowded.sort()
    unsorted = signed[torch.randperm(256, generator=generator)]
    swapped = signed.clone()
    swapped[[50, 51]] = swapped[[51, 50]]
    with_inf, with_nan = signed.clone(), signed.clone()
    with_inf[255], with_nan[3] = math.inf, math.nan
    bins = 2 if _has_vbmi() else 1
    for name, qmap, table in [
        ("paired", paired, bins), ("repeated", repeated, 1), ("crowded", crowded, 1), ("unsorted", unsorted, 0),
        ("swapped", swapped, 0), ("inf", with_inf, 0), ("nan", with_nan, 0),
    ]:  # fmt: skip
        x = _search_inputs(qmap, generator, sample=16) if name in ("paired", "repeated", "crowded") else torch.cat(
            [torch.randint(-(2**31), 2**31, (1 << 20,), generator=generator).to(torch.int32).view(torch.float32),
             torch.rand(1 << 18, generator=generator) * 2 - 1, qmap, _ulps(qmap, 1), _ulps(qmap, -1)]
        )  # fmt: skip
        fast, reference, used = _search(qmap, x)
        assert used == table, name
        assert int((fast != reference).sum()) == 0, name
        assert int((reference != quantize_8bit_with_qmap(x, qmap)).sum()) == 0, name


def _torchao_and_ours(n, generator, count=1, steps_before=0.0):
    """``count`` parameters of ``n`` values: torchao AdamW8bit on fp32 masters and our lean copies, with the same fresh
    8-bit states (torchao's own objects, each with its own maps; step counts at ``steps_before``), ready for
    :func:`_step_both`."""
    leans = [_lean((n,), generator) for _ in range(count)]
    masters = [torch.nn.Parameter(join_fp32(high, low).clone()) for high, low in leans]
    optimizer = torchao_optim.AdamW8bit(masters, lr=1e-2)
    ours = []
    for master, (high, low) in zip(masters, leans):
        state = dict(step=torch.tensor(steps_before), exp_avg=_zeros_state((n,), True))
        state["exp_avg_sq"] = _zeros_state((n,), False)
        optimizer.state[master] = state
        mine = {key: _clone(value) for key, value in state.items()}
        ours.append(adam8bit.Adam8bitPiece(high, low, None, mine["exp_avg"], mine["exp_avg_sq"], mine["step"]))
    return masters, optimizer, ours


def _step_both(masters, optimizer, ours, generator):
    for master, piece in zip(masters, ours):
        piece.grad = (torch.randn(master.shape, generator=generator) * 1e-2).bfloat16()
        master.grad = piece.grad.float()
    optimizer.step()
    adam8bit.adam8bit_step_pieces(ours, lr=optimizer.param_groups[0]["lr"])
    for master, piece in zip(masters, ours):
        assert torch.equal(join_fp32(piece.high, piece.low).view(torch.int32), master.detach().view(torch.int32))
        state = optimizer.state[master]
        assert _differences(piece.exp_avg, state["exp_avg"]) == {"codes": 0, "scales": 0}
        assert _differences(piece.exp_avg_sq, state["exp_avg_sq"]) == {"codes": 0, "scales": 0}


@pytest.mark.parametrize("steps_before", [300.0, 20000.0])
def test_late_steps_bitwise_torchao(steps_before):
    """From step 300 on, where 1 - beta1 ** step is 1 in fp32 (the kernel leaves out the division by it), and from
    step 20000 on, where sqrt(1 - beta2 ** step) is 1 too (both divisions left out): torchao's bits."""
    generator = torch.Generator().manual_seed(35)
    masters, optimizer, ours = _torchao_and_ours(8192, generator, count=2, steps_before=steps_before)
    for _ in range(3):
        _step_both(masters, optimizer, ours, generator)
    first = steps_before + 1
    assert _f32(1 - _powf(_f32(0.9), first)) == 1.0  # fp32's bc1 at the first of these steps
    bc2_sqrt = _f32(math.sqrt(_f32(1 - _powf(_f32(0.999), first))))
    assert (bc2_sqrt == 1.0) == (steps_before == 20000.0)


def test_qmap_edited_in_place():
    """A map edited in place between steps (same address, new values: a scaled map, then an unsorted one): the next
    step uses the new values (no stale table or dequantization), torchao's bits."""
    generator = torch.Generator().manual_seed(31)
    masters, optimizer, ours = _torchao_and_ours(4096, generator)
    state, piece = optimizer.state[masters[0]], ours[0]
    _step_both(masters, optimizer, ours, generator)
    for edit in (lambda q: q.mul_(0.5), lambda q: q.copy_(q.flip(0))):
        for moment in (state["exp_avg"], state["exp_avg_sq"], piece.exp_avg, piece.exp_avg_sq):
            edit(moment.qmap)
        _step_both(masters, optimizer, ours, generator)
    _step_both(masters, optimizer, ours, generator)


def _edit_maps(moments, k):
    for moment in moments:
        moment.qmap.mul_(1 - k / 64)  # values of its own: a map (and table) per parameter


def test_more_maps_than_the_cache_holds():
    """Twelve parameters with maps of different values in one call: 24 maps, more than the cache's slots (some pieces
    search and dequantize without a table): torchao's bits."""
    generator = torch.Generator().manual_seed(32)
    masters, optimizer, ours = _torchao_and_ours(4096, generator, count=12)
    for k, (master, piece) in enumerate(zip(masters, ours)):
        state = optimizer.state[master]
        _edit_maps([state["exp_avg"], state["exp_avg_sq"], piece.exp_avg, piece.exp_avg_sq], k)
    for _ in range(3):
        _step_both(masters, optimizer, ours, generator)


def test_concurrent_calls():
    """Four Python threads stepping their own parameters at once (the kernel runs without the GIL), 24 maps of
    different values among them: the same bytes as the same calls made one at a time."""
    import threading

    def pieces():
        generator = torch.Generator().manual_seed(33)
        made = [_quantized_piece(generator, 8192) for _ in range(12)]
        for k, piece in enumerate(made):
            _edit_maps([piece.exp_avg, piece.exp_avg_sq], k)
        return made

    generator = torch.Generator().manual_seed(34)
    grads = [[(torch.randn(8192, generator=generator) * 1e-2).bfloat16() for _ in range(12)] for _ in range(4)]
    groups = [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]

    def run(made, group):
        for step_grads in grads:
            for k in group:
                made[k].grad = step_grads[k]
            adam8bit.adam8bit_step_pieces([made[k] for k in group], lr=1e-2)

    alone, together = pieces(), pieces()
    for group in groups:
        run(alone, group)
    threads = [threading.Thread(target=run, args=(together, group)) for group in groups]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for a, b in zip(alone, together):
        for x, y in zip(_piece_tensors(a), _piece_tensors(b)):
            assert _same_bytes(x, y)
