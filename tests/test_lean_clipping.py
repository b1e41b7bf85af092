"""Clipping of lean masters' gradients (``lightning_mp.master.lean.clipping``, ``RemainderMasters.clip_grad_norm_``):
one ``_foreach_norm`` per (device, dtype) group, and the total norm, the clip factor and the clipped step bitwise
``torch.nn.utils.clip_grad_norm_`` on fp32 copies of the gradients, for the norm types Lightning passes (2 and inf),
with bf16 and fp32 gradients interleaved (the per-gradient norms are taken in the gradients' order, as torch's on
all-fp32 masters: the order changes the total's last bits)."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from torch import nn

from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean.chunked import apply_grad_ops_in_place
from tests.helpers import AtenOps


def _model(blocks: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(16, 16), nn.LayerNorm(16)]  # bf16 (lean) and fp32 parameters interleaved
    return nn.Sequential(*layers)


def _setup(blocks: int, seed: int):
    model = _model(blocks, seed)
    reference = copy.deepcopy(model)  # fp32 parameters holding the exact values, torch's clipping on fp32 grads
    store = RemainderMasters()
    store.convert(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store.attach([optimizer])
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    generator = torch.Generator().manual_seed(seed)
    for param, ref in zip(model.parameters(), reference.parameters()):  # gradients of many magnitudes
        scale = 10.0 ** torch.randint(-3, 3, (), generator=generator).item()
        grad = (torch.randn(param.shape, generator=generator) * scale).to(param.dtype)
        param.grad, ref.grad = grad, grad.to(torch.float32, copy=True)  # not shared: clipping writes in place
    return model, reference, store, optimizer, ref_optimizer


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_lean_clip_by_norm_is_bitwise_torchs_on_fp32_gradients(norm_type):
    order_mattered = False
    for seed in range(6):
        model, reference, store, optimizer, ref_optimizer = _setup(blocks=6, seed=seed)
        assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16, torch.float32}
        total = store.clip_grad_norm_(optimizer, 0.5, norm_type)
        grads = [p.grad for p in reference.parameters()]
        norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
        grouped = [n for n, p in zip(norms, model.parameters()) if p.dtype == torch.bfloat16]
        grouped += [n for n, p in zip(norms, model.parameters()) if p.dtype == torch.float32]
        in_groups = torch.linalg.vector_norm(torch.stack(grouped), norm_type)
        ref_total = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5, norm_type)
        order_mattered |= not torch.equal(in_groups, ref_total)
        assert torch.equal(total, ref_total), seed
        store.fused_step(optimizer, None)
        ref_optimizer.step()
        for param, ref in zip(model.parameters(), reference.parameters()):
            exact = store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()
            assert torch.equal(exact, ref), seed
    if norm_type == 2.0:  # the case is one where the norms' order shows in the total (max is order-free)
        assert order_mattered


def test_lean_clip_by_norm_takes_torchs_arguments():
    model, reference, store, optimizer, _ = _setup(blocks=2, seed=0)
    slow = store.clip_grad_norm_(optimizer, 0.5, foreach=False)
    store._grad_ops.clear()
    assert torch.equal(slow, store.clip_grad_norm_(optimizer, 0.5, foreach=True))
    assert torch.equal(slow, torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.5))
    model[0].weight.grad[0, 0] = float("inf")
    assert store.clip_grad_norm_(optimizer, 0.5).isinf()  # error_if_nonfinite=False, torch's default
    with pytest.raises(RuntimeError, match="non-finite"):
        store.clip_grad_norm_(optimizer, 0.5, error_if_nonfinite=True)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_lean_clipping_issues_the_same_ops_whatever_the_parameter_count(clip):
    counts = []
    for blocks in (2, 12):
        model, _, store, optimizer, _ = _setup(blocks, seed=1)
        with AtenOps() as ops:
            if clip == "norm":
                store.clip_grad_norm_(optimizer, 0.5)
            else:
                store.clip_grad_value_(optimizer, 1e-3)
            fp32 = [p for p in model.parameters() if p.dtype == torch.float32]
            apply_grad_ops_in_place(fp32, store._grad_ops[id(optimizer)])  # the fp32 gradients' part of the step
        counts.append(dict(Counter(ops.ops)))
    assert counts[0] == counts[1]
    assert sum(counts[0].values()) <= (9 if clip == "norm" else 2), counts[0]
