"""An optimizer swapped mid-fit (``trainer.strategy.setup_optimizers(trainer)`` after the module changes what
``configure_optimizers`` returns, or ``trainer.strategy.optimizers = [new]``) is the one the masters and the step
inside backward follow (lightning_mp.master.held_optimizers).

References: the normal lean step (``master_weights="remainder"``) for the step inside backward, bit for bit (with the
one-pass kernel, and on the chunked path: ``LIGHTNING_MP_NATIVE=0``); Lightning's built-in ``bf16-mixed`` (fp32
weights, fp32 optimizer) for ``master_weights=True``, within the ties of its bf16 forward.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

MODES = {"true": (True, False), "lean": ("remainder", False), "in_backward": ("remainder", True)}


class Phased(L.LightningModule):
    """AdamW in epoch 0; from epoch 1 the optimizer ``second`` over ``which`` parameters, set up by ``how``."""

    def __init__(self, second: str = "adamw", how: str = "setup", which: str = "all") -> None:
        super().__init__()
        with seeded():
            self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
        self.second, self.how, self.which, self.phase = second, how, which, 0
        self.old: Optional[torch.optim.Optimizer] = None
        self.hooks: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        if self.phase == 0:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        params = self.parameters() if self.which == "all" else self.net[3].parameters()
        if self.second == "sgd":
            return torch.optim.SGD(params, lr=5e-2, momentum=0.9, weight_decay=0.1)
        if self.second == "radam":  # not AdamW/Adam/SGD: lean masters' generic path
            return torch.optim.RAdam(params, lr=3e-3, weight_decay=0.01)
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch != 1:
            return
        self.phase, self.old = 1, self.trainer.optimizers[0]
        if self.how == "setup":  # Lightning's documented way to change optimizers during fit
            self.trainer.strategy.setup_optimizers(self.trainer)
        else:
            self.trainer.strategy.optimizers = [self.configure_optimizers()]

    def on_train_batch_end(self, *args: Any) -> None:
        self.hooks.append(max(len(p._post_accumulate_grad_hooks or ()) for p in self.parameters()))


def _loader() -> DataLoader:
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(mode: Optional[str], tmp_path: Any = None, **options: Any) -> tuple[Phased, L.Trainer]:
    """Three epochs of three steps, the swap at epoch 1; ``mode=None``: Lightning's built-in bf16-mixed."""
    model = Phased(**options)
    kwargs: dict[str, Any] = dict(max_epochs=3)
    if tmp_path is not None:  # a checkpoint at the end of fit: the swapped optimizer's state
        kwargs.update(default_root_dir=tmp_path, enable_checkpointing=True)
        kwargs["callbacks"] = [ModelCheckpoint(dirpath=tmp_path, filename=mode or "builtin", save_last=False)]
    if mode is None:
        trainer = make_trainer(None, precision="bf16-mixed", **kwargs)
    else:
        master_weights, in_backward = MODES[mode]
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights, optimizer_in_backward=in_backward)
        trainer = make_trainer(plugin, **kwargs)
    trainer.fit(model, _loader())
    return model, trainer


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _max_diff(ours: nn.Module, reference: nn.Module) -> float:
    theirs = _weights(reference)
    return max((value - theirs[name]).abs().max().item() for name, value in _weights(ours).items())


def _assert_states(ours: dict[str, Any], reference: dict[str, Any], exact: bool) -> None:
    assert ours["state"].keys() == reference["state"].keys() and ours["state"]
    for index, state in reference["state"].items():
        for key, value in state.items():
            if exact:
                assert torch.equal(ours["state"][index][key], value), (index, key)
            else:
                torch.testing.assert_close(ours["state"][index][key], value, rtol=0, atol=1e-6)
    assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in reference["param_groups"]]


@pytest.mark.parametrize("how", ["setup", "assign"])
@pytest.mark.parametrize("second", ["adamw", "sgd", "radam"])
def test_a_swapped_optimizer_is_stepped_inside_backward_bitwise_as_the_normal_lean_step(second, how):
    ours, trainer = _fit("in_backward", second=second, how=how)
    reference, reference_trainer = _fit("lean", second=second, how=how)
    assert _max_diff(ours, reference) == 0.0  # main at 9108c26: 0.042 (AdamW), 0.69 (SGD): the old one kept stepping
    assert isinstance(trainer.optimizers[0], type(ours.configure_optimizers()))
    _assert_states(trainer.optimizers[0].state_dict(), reference_trainer.optimizers[0].state_dict(), exact=True)
    assert set(ours.hooks) == {1}  # one hook per parameter all along: the old optimizer's were removed
    assert not torch.equal(_weights(ours)["net.0.weight"], _weights(Phased())["net.0.weight"])


def test_a_swapped_optimizer_inside_backward_is_bitwise_the_chunked_path(monkeypatch):
    monkeypatch.setenv("LIGHTNING_MP_NATIVE", "0")  # no one-pass kernel: torch's fused kernel on joined chunks
    ours = _fit("in_backward", second="sgd")[0]
    assert _max_diff(ours, _fit("lean", second="sgd")[0]) == 0.0


@pytest.mark.parametrize("how", ["setup", "assign"])
@pytest.mark.parametrize("second", ["adamw", "sgd"])
def test_fp32_masters_step_a_swapped_optimizer_as_lightnings_bf16_mixed(second, how):
    ours, trainer = _fit("true", second=second, how=how)
    builtin, builtin_trainer = _fit(None, second=second, how=how)
    # main at 9108c26: 0.018 (AdamW), 0.73 (SGD): the new optimizer held the bf16 parameters, which stopped moving
    assert _max_diff(ours, builtin) <= 1e-6
    _assert_states(trainer.optimizers[0].state_dict(), builtin_trainer.optimizers[0].state_dict(), exact=False)
    old = ours.old  # the old optimizer holds the model's parameters again (its masters released to the new one)
    assert all(p.dtype == torch.float32 for g in old.param_groups for p in g["params"])
    assert {id(p) for g in old.param_groups for p in g["params"]} == {id(p) for p in ours.parameters()}


@pytest.mark.parametrize("mode", ["true", "in_backward"])
def test_a_swapped_optimizer_over_fewer_parameters_releases_the_others(mode):
    """The new optimizer trains the last layer only: the others stop where the old one left them (fp32 masters
    released), as in the reference."""
    ours = _fit(mode, which="head")[0]
    reference = _fit(None if mode == "true" else "lean", which="head")[0]
    tolerance = 1e-6 if mode == "true" else 0.0
    assert _max_diff(ours, reference) <= tolerance


@pytest.mark.parametrize("mode", ["true", "lean", "in_backward"])
def test_the_swapped_optimizers_state_is_checkpointed(mode, tmp_path):
    ours = _fit(mode, tmp_path / "ours")
    _fit("lean" if mode == "in_backward" else None, tmp_path / "reference")
    saved = torch.load(next((tmp_path / "ours").glob("*.ckpt")), weights_only=False)
    expected = torch.load(next((tmp_path / "reference").glob("*.ckpt")), weights_only=False)
    assert len(saved["optimizer_states"]) == 1
    _assert_states(saved["optimizer_states"][0], expected["optimizer_states"][0], exact=mode == "in_backward")
    for name, value in expected["state_dict"].items():  # the exact fp32 weights
        torch.testing.assert_close(saved["state_dict"][name], value, rtol=0, atol=0 if mode == "in_backward" else 1e-6)
    assert ours[1].optimizers[0].state_dict()["param_groups"][0]["lr"] == 3e-3


class TwoOptimizers(Phased):
    """Manual optimization (Lightning steps several optimizers only there); two optimizers from epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        optimizers = self.optimizers()
        for optimizer in optimizers if isinstance(optimizers, list) else [optimizers]:
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        if self.phase == 0:
            return super().configure_optimizers()
        return [torch.optim.AdamW(self.net[0].parameters()), torch.optim.AdamW(self.net[3].parameters())]


def test_a_swap_to_several_optimizers_is_refused_inside_backward_before_any_update():
    model, one_epoch = TwoOptimizers(), TwoOptimizers()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    with pytest.raises(ValueError, match="takes exactly one optimizer, got 2"):
        make_trainer(plugin, max_epochs=3).fit(model, _loader())
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    make_trainer(plugin, max_epochs=1).fit(one_epoch, _loader())
    assert _max_diff(model, one_epoch) == 0.0  # stopped after epoch 0, before any update with the two
    assert all(p.dtype == torch.float32 for p in model.parameters())  # teardown gave the exact weights back


def _fabric_run(mode: Optional[str]) -> dict[str, torch.Tensor]:
    """A Fabric loop of 6 steps; at step 3 a new optimizer (SGD) is set up and stepped from then on."""
    with seeded():
        module = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    plugin = None
    if mode is None:
        fabric = L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    else:
        master_weights, in_backward = MODES[mode]
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights, optimizer_in_backward=in_backward)
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    for step in range(6):
        if step == 3:  # under Fabric the optimizers are the ones set up
            optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9))
        fabric.backward(nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True)))
        optimizer.step()
        optimizer.zero_grad()
    if plugin is not None:
        plugin.teardown()  # the model back in fp32, as at the end of a Trainer's fit
    return _weights(module)


@pytest.mark.parametrize("mode", ["true", "lean"])
def test_fabric_masters_follow_an_optimizer_set_up_mid_loop_as_lightnings_bf16_mixed(mode):
    ours, builtin = _fabric_run(mode), _fabric_run(None)
    for name, value in builtin.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=1e-6)


def test_fabric_inside_backward_refuses_a_second_optimizer_when_it_is_set_up():
    with pytest.raises(ValueError, match="takes exactly one optimizer, got 2"):
        _fabric_run("in_backward")
