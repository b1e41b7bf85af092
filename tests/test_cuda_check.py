"""The bf16 gradient check of the step inside backward on CUDA: one Triton launch per gradient
(``lightning_mp.kernels.cuda.check_nonfinite``), where the inf-norm way (``grads.check_and_unscale_by_norm_``, for
torch's check takes no bf16 on CUDA) is about eight ops per parameter (issue 43, item 6).

The kernel is checked against a reference (``torch.isfinite(x).all()``) for every kind of value at every place of a
block and across block edges, interpreted on the CPU where Triton is installed without a GPU (``TRITON_INTERPRET``),
and on a GPU where there is one, with its op count.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed here (CUDA builds of torch ship it)")

from lightning_mp.kernels import cuda  # noqa: E402

SIZES = [1, 7, cuda.CHECK_BLOCK - 1, cuda.CHECK_BLOCK, cuda.CHECK_BLOCK + 1, 3 * cuda.CHECK_BLOCK + 5]
BAD = [float("inf"), float("-inf"), float("nan")]


@pytest.fixture
def device(monkeypatch) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(cuda, "_kernels", {})
    return torch.device("cpu")


def _flag(device: torch.device, value: float = 0.0) -> torch.Tensor:
    return torch.tensor([7.0, value, 7.0], device=device)[1]  # a 0-dim view into a vector, as a step flag's slot


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_check_finds_every_non_finite_value_wherever_it_is_and_nothing_else(device, dtype):
    generator = torch.Generator().manual_seed(0)
    for size in SIZES:
        clean = (torch.randn(size, generator=generator) * 1e3).to(dtype)
        clean[0] = torch.finfo(dtype).max  # the largest finite values are finite
        clean[-1] = -torch.finfo(dtype).max
        found = _flag(device)
        assert cuda.check_nonfinite([clean.to(device)], found)
        assert found.item() == 0.0 and bool(torch.isfinite(clean).all())
        places = sorted({0, size // 2, size - 1, min(size - 1, cuda.CHECK_BLOCK), min(size - 1, cuda.CHECK_BLOCK - 1)})
        for place in places:
            for bad in BAD:
                grad = clean.clone()
                grad[place] = bad
                found = _flag(device)
                assert cuda.check_nonfinite([clean.to(device), grad.to(device)], found)
                assert found.item() == 1.0 and not bool(torch.isfinite(grad).all()), (size, place, bad)


def test_the_check_only_sets_the_flag_and_writes_no_gradient(device):
    grad = torch.randn(5000).to(torch.bfloat16)
    grad[4321] = float("nan")
    before = grad.clone()
    found = _flag(device, 1.0)  # a flag already set stays set (never reset, as torch's check)
    on_device = grad.to(device)
    assert cuda.check_nonfinite([on_device], found) and found.item() == 1.0
    assert torch.equal(on_device.cpu().view(torch.int16), before.view(torch.int16))  # the NaN's bits too
    clean = _flag(device)
    assert cuda.check_nonfinite([torch.zeros(0, dtype=torch.bfloat16, device=device)], clean) and clean.item() == 0.0


def test_lists_it_does_not_take_are_left_to_torch(device):
    grads = [torch.ones(4, dtype=torch.bfloat16, device=device) for _ in range(cuda.CHECK_MAX_TENSORS + 1)]
    assert not cuda.check_nonfinite(grads, _flag(device))  # long lists: torch's foreach ops, a few launches in all
    strided = torch.ones(8, 8, dtype=torch.bfloat16, device=device).t()
    assert not cuda.check_nonfinite([strided], _flag(device))
    assert not cuda.check_nonfinite([grads[0]], torch.zeros((), dtype=torch.float64, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the op count of the CUDA path)")
def test_the_hooks_bf16_check_on_cuda_is_one_launch_and_no_torch_op():
    from torch.profiler import ProfilerActivity, profile

    from lightning_mp.grads import non_finite_check_and_unscale_
    from tests.helpers import AtenOps

    grad = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    found, ones = torch.zeros(1, device="cuda"), torch.ones(1, device="cuda")
    non_finite_check_and_unscale_([grad], found, ones, check_only=True)  # compiled once
    with AtenOps() as ops, profile(activities=[ProfilerActivity.CUDA]) as prof:
        non_finite_check_and_unscale_([grad], found, ones, check_only=True)
        torch.cuda.synchronize()
    assert ops.ops == []  # no torch op: the inf-norm way was about eight per parameter
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and found.item() == 0.0
    grad[12345] = float("inf")
    non_finite_check_and_unscale_([grad], found, ones, check_only=True)
    assert found.item() == 1.0
