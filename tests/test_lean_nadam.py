"""NAdam on lean master weights, added to the fast path by one entry of the table (``master/lean/optimizers.py``).

The chunked update runs torch's own foreach function (``torch.optim.nadam._multi_tensor_nadam``) on the exact fp32
values, chunk by chunk; the reference is ``torch.optim.NAdam(foreach=True)`` on fp32 parameters holding the same
values and given the same gradients: bitwise, weights and state, over several steps with weight decay, a skipped
step (the found-inf flag) and a checkpoint round trip; and the step inside backward against the normal step.
"""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master import RemainderMasters
from lightning_mp.master.lean.optimizers import TABLE
from tests.helpers import make_trainer, seeded

CASES = [
    dict(lr=1e-2, weight_decay=0.1),
    dict(lr=1e-2, weight_decay=0.05, decoupled_weight_decay=True, betas=(0.8, 0.95), momentum_decay=0.01),
    dict(lr=1e-3, maximize=True),
]


def _exact(store: RemainderMasters, param: torch.Tensor) -> torch.Tensor:
    return store.fp32_value(param) if param.dtype == torch.bfloat16 else param.detach()


def _round_trip(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s state saved to bytes and loaded back (a resume), as a checkpoint would carry it."""
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    optimizer.load_state_dict(torch.load(buffer, weights_only=True))


def _assert_same(store, model, optimizer, reference, ref_optimizer) -> None:
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert torch.equal(_exact(store, param), ref)
    state, ref_state = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    assert state.keys() == ref_state.keys() and state
    for index, values in ref_state.items():
        assert state[index].keys() == values.keys()
        for key, value in values.items():
            assert state[index][key].dtype == value.dtype and torch.equal(state[index][key], value), (index, key)


@pytest.mark.parametrize("chunk_size", [32768, 1 << 20])
@pytest.mark.parametrize("kwargs", CASES)
def test_nadam_equals_torchs_foreach_nadam_on_fp32_masters_bitwise(kwargs, chunk_size):
    """chunk_size 32768 cuts the 99900-element weight into four pieces (each sees the step count and mu_product
    before the update; the parameter advances once) and puts several tensors in one chunk."""
    with seeded():
        model = nn.Sequential(nn.Linear(300, 333), nn.LayerNorm(333), nn.Linear(333, 7))
    reference = copy.deepcopy(model)
    store = RemainderMasters(chunk_size=chunk_size)
    store.convert(model)
    optimizer = torch.optim.NAdam(model.parameters(), **kwargs)
    store.attach([optimizer])
    assert store.updates.of(optimizer).generic is None  # the table's entry: not the generic path
    ref_optimizer = torch.optim.NAdam(reference.parameters(), **kwargs, foreach=True)
    generator = torch.Generator().manual_seed(1)
    for step in range(6):
        for param, ref in zip(model.parameters(), reference.parameters()):
            grad = torch.randn(param.shape, generator=generator).to(param.dtype)
            param.grad, ref.grad = grad, grad.float()
        skipped = step == 2
        store.fused_step(optimizer, torch.ones((), dtype=torch.float32) if skipped else torch.zeros(()))
        if not skipped:  # GradScaler.step skips a non-fused optimizer's step() on a non-finite gradient
            ref_optimizer.step()
        _assert_same(store, model, optimizer, reference, ref_optimizer)
        if step == 3:
            _round_trip(optimizer)
            _round_trip(ref_optimizer)
            _assert_same(store, model, optimizer, reference, ref_optimizer)


class _Net(L.LightningModule):
    def __init__(self, bad_loss_at: int) -> None:
        super().__init__()
        self.bad_loss_at = bad_loss_at
        self.entries: list[Any] = []
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        return loss * float("nan") if self.trainer.global_step == self.bad_loss_at else loss

    def on_train_batch_end(self, *args: Any) -> None:  # the path each step took: the table's entry
        self.entries.append(self.trainer.precision_plugin.masters.updates.of(self.trainer.optimizers[0]).entry)

    def configure_optimizers(self) -> Any:
        return torch.optim.NAdam(self.parameters(), lr=1e-2, weight_decay=0.01)


def _fit(in_backward: bool, tmp_path: Path, name: str, max_steps: int, resume: Any = None) -> dict[str, Any]:
    with seeded():
        model = _Net(bad_loss_at=1)
    x = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    trainer = make_trainer(plugin, max_steps=max_steps, max_epochs=-1)
    trainer.fit(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8), ckpt_path=resume)
    assert model.entries and all(entry is TABLE[torch.optim.NAdam] for entry in model.entries)  # not generic
    path = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


def _assert_same_bits(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    for key, value in reference["state_dict"].items():
        assert value.dtype == torch.float32 and torch.equal(ours["state_dict"][key], value), key
    states, reference_states = ours["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"]
    assert states.keys() == reference_states.keys() and states
    for index, state in reference_states.items():
        assert states[index].keys() == state.keys() == {"step", "mu_product", "exp_avg", "exp_avg_sq"}
        for key, value in state.items():
            assert torch.equal(states[index][key], value), (index, key)
    assert ours["global_step"] == reference["global_step"]


def test_nadam_inside_backward_equals_the_normal_lean_step_bitwise_and_resumes_on_either(tmp_path):
    """Six steps inside backward against six normal ones (a non-finite loss at step 1 skips every update of that
    step on both paths), and a checkpoint of three steps inside backward resumed on either path."""
    _assert_same_bits(_fit(True, tmp_path, "ours", max_steps=6), _fit(False, tmp_path, "normal", max_steps=6))
    _fit(True, tmp_path, "first", max_steps=3)
    resumed = _fit(True, tmp_path, "resumed", max_steps=6, resume=tmp_path / "first.ckpt")
    _assert_same_bits(resumed, _fit(False, tmp_path, "then", max_steps=6, resume=tmp_path / "first.ckpt"))
    assert resumed["global_step"] == 6


def test_nadam_is_one_entry_of_the_table():
    assert torch.optim.NAdam in TABLE
