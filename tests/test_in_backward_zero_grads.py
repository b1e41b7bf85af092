"""Inside backward, what the normal lean step updates is updated, zero gradients included, and nothing else.

With ``zero_grad(set_to_none=False)`` a parameter frozen mid-fit (by hand or by Lightning's ``BaseFinetuning``) keeps
a gradient of zeros, which torch's optimizer and the normal lean step keep updating (weight decay, momentum, Adam's
step count); with ``set_to_none=True`` it is left alone. The reference of every run is the normal lean step
(``optimizer_in_backward=False``) on the same model, data and seed: the same bits, weights and optimizer state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, BaseFinetuning
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded
from tests.test_in_backward import Net, _loader


def _assert_same_bits(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    """Every tensor of the checkpoints' weights, buffers and optimizer state equal, bit for bit."""
    assert ours["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    states, reference_states = ours["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"]
    assert states.keys() == reference_states.keys() and states
    for index, state in reference_states.items():
        assert states[index].keys() == state.keys(), index
        for key, value in state.items():
            assert torch.equal(states[index][key], value), (index, key)
    assert ours["global_step"] == reference["global_step"]


class FreezeByHand(Net):
    """``net.0`` (bf16 + remainder) and ``net.1`` (the LayerNorm, kept fp32) frozen at step 2 by
    ``requires_grad_(False)``, unfrozen at step 4; ``zero_grad`` with the given ``set_to_none``."""

    def __init__(self, optimizer: str, set_to_none: bool) -> None:
        super().__init__(optimizer)
        self.set_to_none = set_to_none

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step in (2, 4):
            for module in (self.net[0], self.net[1]):
                module.requires_grad_(self.trainer.global_step == 4)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=self.set_to_none)


def _fit(model_class: type, in_backward: bool, tmp_path: Path, *args: Any, **trainer_kw: Any) -> dict[str, Any]:
    with seeded():
        model = model_class(*args)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    trainer = make_trainer(plugin, **trainer_kw)
    trainer.fit(model, trainer_kw.pop("loader", None) or _loader())
    path = tmp_path / f"{in_backward}.ckpt"
    trainer.save_checkpoint(path)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_parameters_frozen_by_hand_are_updated_as_the_normal_step_updates_them(tmp_path, optimizer, set_to_none):
    ours = _fit(FreezeByHand, True, tmp_path, optimizer, set_to_none, max_steps=6)
    reference = _fit(FreezeByHand, False, tmp_path, optimizer, set_to_none, max_steps=6)
    _assert_same_bits(ours, reference)
    frozen_at_2 = _fit(FreezeByHand, False, tmp_path, optimizer, set_to_none, max_steps=2)["state_dict"]
    frozen_at_4 = _fit(FreezeByHand, False, tmp_path, optimizer, set_to_none, max_steps=4)["state_dict"]
    # the case is the one meant: frozen parameters move with zero gradients only when zero_grad keeps them
    moved = not torch.equal(frozen_at_2["net.0.weight"], frozen_at_4["net.0.weight"])
    assert moved == (not set_to_none)


class Unused(Net):
    """``net.1`` (LayerNorm) is skipped by the forward at odd steps: no gradient, but a zero one is kept by
    ``zero_grad(set_to_none=False)``."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.net[0](x)
        if self.trainer.global_step % 2 == 0:
            hidden = self.net[1](hidden)
        out = self.net[3](self.net[2](hidden))
        return nn.functional.mse_loss(out.float(), y)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=False)


def test_a_parameter_the_forward_skipped_is_updated_with_its_kept_zero_gradient(tmp_path):
    _assert_same_bits(_fit(Unused, True, tmp_path, max_steps=5), _fit(Unused, False, tmp_path, max_steps=5))


class NoZeroGrad(Net):
    """Never zeroes its gradients (a manual loop that relies on the step inside backward freeing them)."""

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        pass


def test_without_zero_grad_the_probe_gradient_does_not_accumulate(tmp_path):
    # the normal step would accumulate across steps here; inside backward each gradient is its backward's, the kept
    # probe's included: the same bits as zeroing with set_to_none=True
    class SetToNone(Net):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=True)

    _assert_same_bits(_fit(NoZeroGrad, True, tmp_path, max_steps=4), _fit(SetToNone, False, tmp_path, max_steps=4))


# ---------------------------------------------------------------------------------------------- Lightning's callbacks
class FinetuningModel(L.LightningModule):
    """Ported from Lightning's ``tests/tests_pytorch/callbacks/test_finetuning_callback.py::test_finetuning_callback``
    (``FinetuningBoringModel``: a ``Linear -> BatchNorm1d -> ReLU`` backbone and a ``Linear`` layer, SGD over the
    layer with ``StepLR``; ``BackboneFinetuning`` unfreezes the backbone and adds its param group). Adapted: random
    regression data of our own, fewer epochs, SGD with momentum and weight decay, ``set_to_none`` chosen, and the
    backbone frozen again by hand (``BaseFinetuning.freeze``) one epoch after the callback unfroze it."""

    def __init__(self, set_to_none: bool, refreeze_at: int = -1) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU())
        self.layer = nn.Linear(32, 2)
        self.set_to_none, self.refreeze_at = set_to_none, refreeze_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == self.refreeze_at:
            BaseFinetuning.freeze(self.backbone, train_bn=False)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        optimizer.zero_grad(set_to_none=self.set_to_none)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)]


def _finetuning_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :2] * 2), batch_size=4)


@pytest.mark.parametrize("set_to_none", [False, True])
def test_backbone_finetuning_then_freeze_matches_the_normal_step(tmp_path, set_to_none):
    def fit(in_backward: bool) -> dict[str, Any]:
        with seeded():
            model = FinetuningModel(set_to_none, refreeze_at=3)
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
        callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, verbose=False)
        trainer = make_trainer(plugin, max_epochs=5, callbacks=[callback])
        trainer.fit(model, _finetuning_loader())
        assert len(trainer.optimizers[0].param_groups) == 2  # the callback added the backbone's group
        path = tmp_path / f"finetune-{in_backward}.ckpt"
        trainer.save_checkpoint(path)
        return torch.load(path, weights_only=True)

    _assert_same_bits(fit(True), fit(False))
