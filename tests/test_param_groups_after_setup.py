"""Param groups added during fit (``optimizer.add_param_group``) are followed by the masters and the step inside
backward: Lightning's real ``BackboneFinetuning`` callback, a user's callback, any optimizer.

References: the normal lean step (``master_weights="remainder"``) for the step inside backward, bit for bit; Lightning's
built-in ``bf16-mixed`` (fp32 weights, fp32 AdamW) for the masters, to within what the bf16 forward allows.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

MODES = {  # name -> (master_weights, optimizer_in_backward)
    "true": (True, False),
    "lean": ("remainder", False),
    "in_backward": ("remainder", True),
}


class Finetuned(L.LightningModule):
    """A ``backbone`` (frozen at first by the callbacks below) and a ``head``; the optimizer starts on the head."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        with seeded():
            self.backbone = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16))
            self.head = nn.Linear(16, 1)
        self.optimizer_name = optimizer
        self.freed: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.backbone(x)).float(), y)

    def on_train_batch_end(self, *args: Any) -> None:
        # every gradient used and freed inside backward but the probe's: the smallest parameter keeps a gradient of
        # zeros to see what zero_grad does (master/in_backward_zero_grads.py)
        kept = [p.grad for p in self.parameters() if p.grad is not None]
        self.freed.append(len(kept) <= 1 and not any(grad.any() for grad in kept))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "radam":  # not AdamW/Adam/SGD: the generic path (its own step on fp32 slices)
            return torch.optim.RAdam(params, lr=1e-2, weight_decay=0.1)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class AddBackbone(Callback):
    """A user's callback: the backbone frozen at setup, unfrozen and added as a new group at epoch ``at``."""

    def __init__(self, at: int = 1) -> None:
        self.at = at

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        pl_module.backbone.requires_grad_(False)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.at:
            pl_module.backbone.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.backbone.parameters()), "lr": 5e-3})


def _loader() -> DataLoader:
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(mode: Optional[str], callback: Callback, optimizer: str = "adamw") -> tuple[Finetuned, dict[str, Any]]:
    """Three epochs of three steps; the module (its fp32 weights after teardown) and its optimizer's state dict."""
    model = Finetuned(optimizer)
    if mode is None:  # Lightning's built-in bf16-mixed: the reference of the masters
        trainer = make_trainer(None, precision="bf16-mixed", max_epochs=3, callbacks=[callback])
    else:
        master_weights, in_backward = MODES[mode]
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights, optimizer_in_backward=in_backward)
        trainer = make_trainer(plugin, max_epochs=3, callbacks=[callback])
    trainer.fit(model, _loader())
    return model, trainer.optimizers[0].state_dict()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_same_bits(ours: tuple[Finetuned, dict], reference: tuple[Finetuned, dict]) -> None:
    for name, value in _weights(reference[0]).items():
        assert value.dtype == torch.float32 and torch.equal(_weights(ours[0])[name], value), name
    states, expected = ours[1]["state"], reference[1]["state"]
    assert states.keys() == expected.keys() and len(ours[1]["param_groups"]) == 2
    for index, state in expected.items():
        for key, value in state.items():
            assert torch.equal(states[index][key], value), (index, key)


@pytest.mark.parametrize("callback", ["backbone_finetuning", "user"])
def test_an_added_group_is_updated_inside_backward_bitwise_as_the_normal_lean_step(callback):
    make = (lambda: BackboneFinetuning(1, lambda epoch: 1.0)) if callback == "backbone_finetuning" else AddBackbone
    ours = _fit("in_backward", make())
    reference = _fit("lean", make())
    _assert_same_bits(ours, reference)
    initial = _weights(Finetuned())
    assert not torch.equal(ours[0].backbone[0].weight, initial["backbone.0.weight"])  # the backbone moved
    assert ours[1]["state"][2]["step"].item() == 6  # the backbone's first tensor: epochs 1 and 2, 3 steps each
    assert all(ours[0].freed)  # every gradient (the new group's too) used and freed inside backward
    builtin = _fit(None, make())[0]  # and the masters follow the exact fp32 training of Lightning's bf16-mixed
    for name, value in _weights(builtin).items():
        torch.testing.assert_close(_weights(ours[0])[name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["true", "lean"])
def test_masters_follow_a_group_added_by_a_callback_as_the_fp32_training_does(mode):
    ours = _fit(mode, AddBackbone())[0]
    builtin = _fit(None, AddBackbone())[0]
    initial = _weights(Finetuned())
    assert not torch.equal(ours.backbone[0].weight, initial["backbone.0.weight"])
    for name, value in _weights(builtin).items():
        torch.testing.assert_close(_weights(ours)[name], value, rtol=0, atol=1e-6)


def test_any_other_optimizer_follows_an_added_group_inside_backward_bitwise():
    ours = _fit("in_backward", AddBackbone(), "radam")
    reference = _fit("lean", AddBackbone(), "radam")
    assert not torch.equal(ours[0].backbone[0].weight, _weights(Finetuned())["backbone.0.weight"])
    for name, value in _weights(reference[0]).items():
        assert torch.equal(_weights(ours[0])[name], value), name


def test_fp32_masters_refuse_lightnings_finetuning_callbacks_before_any_step():
    with pytest.raises(ValueError, match="master_weights=True cannot run with BackboneFinetuning"):
        _fit("true", BackboneFinetuning(1, lambda epoch: 1.0))


class AddAgain(Callback):
    """Adds the head (already in the optimizer) again as a new group: a user's mistake torch would refuse."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == 1:
            trainer.optimizers[0].param_groups.append({**trainer.optimizers[0].param_groups[0], "params": []})
            trainer.optimizers[0].param_groups[-1]["params"] = list(pl_module.head.parameters())


def test_fp32_masters_refuse_a_parameter_added_twice():
    with pytest.raises(ValueError, match="in the optimizer twice"):
        _fit("true", AddAgain())


class AddAfterBackward(AddBackbone):
    """Adds the backbone between backward and the step: its gradient was made before its hook existed."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.at:
            pl_module.backbone.requires_grad_(True)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.current_epoch == self.at and len(optimizer.param_groups) == 1:
            optimizer.add_param_group({"params": list(pl_module.backbone.parameters())})


def test_a_group_added_after_backward_fails_the_no_update_left_behind_check_inside_backward():
    with pytest.raises(RuntimeError, match="added to the optimizer after backward began"):
        _fit("in_backward", AddAfterBackward())
