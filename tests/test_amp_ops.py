"""The non-finite check and unscale for every gradient dtype: torch's CUDA kernel refuses bf16 gradients (lean
masters' on a GPU); the by-norm path must give torch's flag and values."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.grads import check_and_unscale_by_norm_, non_finite_check_and_unscale_


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", [None, float("inf"), -float("inf"), float("nan")])
def test_by_norm_path_equals_torchs_kernel(dtype, poison):
    torch.manual_seed(0)
    grads = [torch.randn(n).to(dtype) for n in (5, 300, 1)]
    if poison is not None:
        grads[1][17] = poison
    theirs = [g.clone() for g in grads]
    flag, their_flag = torch.zeros(1), torch.zeros(1)
    inv_scale = torch.full((1,), 2.0**-7)
    check_and_unscale_by_norm_(grads, flag, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(theirs, their_flag, inv_scale)
    assert flag.item() == their_flag.item() == (0.0 if poison is None else 1.0)
    for ours, ref in zip(grads, theirs):
        assert torch.equal(ours.isnan(), ref.isnan())
        assert torch.equal(ours.nan_to_num(), ref.nan_to_num())


def test_a_found_flag_stays_set_across_dtype_groups():
    flag = torch.ones(1)
    check_and_unscale_by_norm_([torch.ones(3, dtype=torch.bfloat16)], flag, torch.ones(1))
    assert flag.item() == 1.0
    non_finite_check_and_unscale_([torch.ones(3)], flag, torch.ones(1))
    assert flag.item() == 1.0


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        return self.layer(batch).square().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lean_masters_train_on_cuda_with_bf16_gradients_checked():
    """Failed before with "_amp_foreach_non_finite_check_and_unscale_cuda not implemented for 'BFloat16'"."""
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    trainer = L.Trainer(accelerator="cuda", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[plugin])  # fmt: skip
    model = _Tiny()
    before = model.layer.weight.detach().clone()
    trainer.fit(model, torch.utils.data.DataLoader(torch.randn(12, 16), batch_size=4))
    assert plugin.scaler.skipped_steps == 0
    assert not torch.equal(model.layer.weight.detach().float().cpu(), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("poison", [None, float("inf"), float("nan"), 65504.0])
def test_a_check_only_step_reads_the_gradients_and_finds_what_torchs_kernel_finds(dtype, poison):
    """Check-only (bf16, no loss scale): the CPU check reads without writing back (lightning_mp.kernels.native)."""
    grads = [torch.randn(n).to(dtype) for n in (9, 1 << 20, 3)]
    if poison is not None:
        grads[1][400] = poison
    before = [g.clone() for g in grads]
    flag, their_flag = torch.zeros(1), torch.zeros(1)
    non_finite_check_and_unscale_(grads, flag, torch.ones(1), check_only=True)
    torch._amp_foreach_non_finite_check_and_unscale_([g.clone() for g in grads], their_flag, torch.ones(1))
    assert flag.item() == their_flag.item()
    assert all(torch.equal(g.view(torch.uint8), b.view(torch.uint8)) for g, b in zip(grads, before))


def test_the_norm_check_of_bf16_gradients_finds_non_finite_values_and_writes_nothing_when_check_only():
    """The path CUDA bf16 gradients take (torch's kernel refuses bf16): ``inv_scale=None`` checks without writing
    (the check-only bf16 step; one kernel per gradient saved), an ``inv_scale`` unscales like torch's kernel."""
    from lightning_mp.grads import check_and_unscale_by_norm_

    grads = [torch.randn(300).bfloat16(), torch.randn(7).bfloat16()]
    before = [g.clone() for g in grads]
    found = torch.zeros(1)
    check_and_unscale_by_norm_(grads, found, None)
    assert found.item() == 0 and all(
        torch.equal(g.view(torch.int16), b.view(torch.int16)) for g, b in zip(grads, before)
    )
    grads[1][3] = float("nan")
    check_and_unscale_by_norm_(grads, found, None)
    assert found.item() == 1
    found.zero_()
    check_and_unscale_by_norm_(grads[:1], found, torch.tensor(0.5))
    assert found.item() == 0 and torch.equal(grads[0], (before[0].float() * 0.5).bfloat16())
