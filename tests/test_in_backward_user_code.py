"""User code around the step inside backward that could hand an update a partial gradient or another parameter set.

Each case is either the normal lean step's bits (``master_weights="remainder"`` without ``optimizer_in_backward``:
weights and optimizer state, ``step`` counts included) or one clear error before the update it would spoil.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

STEPS = 4


class Net(L.LightningModule):
    """Linear -> LayerNorm (fp32) -> GELU -> Linear; ``penalty``: a gradient penalty on the input, made with
    ``torch.autograd.grad(create_graph=True)`` inside the training step (WGAN-GP, R1 regularisation)."""

    def __init__(self, penalty: bool = False, setup: Optional[Callable[[nn.Module], None]] = None) -> None:
        super().__init__()
        with seeded():
            self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
        self.penalty = penalty
        if setup is not None:
            setup(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.clone().requires_grad_(self.penalty)
        out = self.net(x).float()
        loss = nn.functional.mse_loss(out, y)
        if self.penalty:
            (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = loss + 0.1 * (grad_x.norm(dim=1) - 1).pow(2).mean()
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def _loader() -> DataLoader:
    x = torch.randn(8 * STEPS, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(in_backward: bool, callbacks: Any = (), **kw: Any) -> tuple[Net, dict[str, Any]]:
    model = Net(**kw)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    trainer = make_trainer(plugin, max_steps=STEPS, callbacks=list(callbacks))
    trainer.fit(model, _loader())
    return model, trainer.optimizers[0].state_dict()


def _assert_same_bits(ours: tuple[Net, dict], reference: tuple[Net, dict]) -> None:
    for (name, value), (_, expected) in zip(ours[0].named_parameters(), reference[0].named_parameters()):
        assert value.dtype == torch.float32 and torch.equal(value, expected), name
    assert ours[1]["state"].keys() == reference[1]["state"].keys() and ours[1]["state"]
    for index, state in reference[1]["state"].items():
        for key, value in state.items():
            assert torch.equal(ours[1]["state"][index][key], value), (index, key)


def test_a_gradient_penalty_made_with_autograd_grad_in_the_step_is_bitwise_the_normal_lean_step():
    # autograd.grad accumulates into no .grad (no hook fires); the double backward through it fires each hook once
    _assert_same_bits(_fit(True, penalty=True), _fit(False, penalty=True))


def _halve_and_clamp(net: nn.Module) -> None:
    net[0].weight.register_hook(lambda grad: (grad * 0.5).clamp(-1e-2, 1e-2))


def _noise_after_accumulation(net: nn.Module) -> None:
    def hook(param: torch.Tensor) -> None:
        param.grad.mul_(0.25)  # rewrites the accumulated gradient in place before the update reads it

    net[3].weight.register_post_accumulate_grad_hook(hook)


@pytest.mark.parametrize("setup", [_halve_and_clamp, _noise_after_accumulation], ids=["tensor_hook", "post_hook"])
def test_a_users_gradient_hook_that_rewrites_gradients_is_seen_by_the_update_as_by_the_normal_step(setup):
    ours = _fit(True, setup=setup)
    reference = _fit(False, setup=setup)
    _assert_same_bits(ours, reference)
    layer = 0 if setup is _halve_and_clamp else 3  # the hooks changed the training: the comparison is not vacuous
    assert not torch.equal(_fit(False)[0].net[layer].weight, reference[0].net[layer].weight)


class LateHook(Callback):
    """Registers a post-accumulate-grad hook once the plugin's hooks are in place: it would run after the update."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.net[3].weight.register_post_accumulate_grad_hook(lambda param: None)


def test_a_post_accumulate_grad_hook_registered_after_setup_is_refused_before_its_parameters_update():
    model = Net()
    before = model.net[3].weight.detach().clone()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    trainer = make_trainer(plugin, max_steps=STEPS, callbacks=[LateHook()])
    with pytest.raises(RuntimeError, match=r"net\.3\.weight has a post-accumulate-grad hook registered after"):
        trainer.fit(model, _loader())
    assert torch.equal(model.net[3].weight.detach(), before)  # teardown gave back the fp32 value: never updated


class Replace(Callback):
    """Replaces a layer's weight by a new ``nn.Parameter`` before the forward of step 2 (the masters follow it)."""

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_step == 2:
            with torch.no_grad():
                value = pl_module.net[0].weight.float() * 0.5 + 0.001
            pl_module.net[0].weight = nn.Parameter(value)


def test_a_parameter_replaced_by_a_callback_is_followed_as_by_the_normal_lean_step():
    ours = _fit(True, [Replace()])
    reference = _fit(False, [Replace()])
    _assert_same_bits(ours, reference)
    assert ours[0].net[0].weight is not None and ours[1]["state"][0]["step"].item() == STEPS - 1  # step 2 went to
    # the replacement (the graph's leaf), as with the normal step; the object the optimizer holds came back


def test_fabric_a_second_backward_through_a_retained_graph_is_refused_before_it_updates_anything():
    with seeded():
        net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    x = torch.randn(8, 8)
    loss = model(x).float().pow(2).mean()
    fabric.backward(loss, retain_graph=True)
    after_first = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="takes one backward per optimizer step"):
        fabric.backward(loss * 2)
    assert all(torch.equal(p.detach(), after_first[name]) for name, p in model.named_parameters())
    assert all(state["step"].item() == 1 for state in opt.state.values())
