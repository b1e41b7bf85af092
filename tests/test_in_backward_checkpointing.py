"""The step inside backward under activation checkpointing, reentrant (a nested backward per region) and not.

A parameter used in several reentrant regions, or inside one and outside it, gets its gradient in parts, one per
nested backward (see :mod:`lightning_mp.master.in_backward.regions`): its update must wait for the whole gradient.
Every run is compared with the normal lean step (``master_weights="remainder"`` without ``optimizer_in_backward``)
on the same model, data and seed: the fp32 weights and the optimizer state (``step`` counts included) bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

STEPS = 4
LAYOUTS = ("outside_then_inside", "inside_then_outside", "shared_block", "sequential", "nested")


class Checkpointed(nn.Module):
    """``layout`` says where the reused Linear ``shared`` runs:

    - ``outside_then_inside``: once outside, then inside a checkpointed region;
    - ``inside_then_outside``: inside a region first, then outside (its outer gradient comes before the region's);
    - ``shared_block``: ALBERT-style, one block applied 3 times, each application its own region;
    - ``sequential``: ``checkpoint_sequential`` over [shared, GELU, shared, GELU] in 2 segments;
    - ``nested``: a region holding another region, ``shared`` in both and outside.
    """

    def __init__(self, layout: str, reentrant: bool) -> None:
        super().__init__()
        self.layout, self.reentrant = layout, reentrant
        self.inp = nn.Linear(8, 16)
        self.shared = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)  # kept fp32 by the masters: an fp32 gradient in the regions too
        self.out = nn.Linear(16, 1)

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.norm(self.shared(h)))

    def region(self, fn: Any, h: torch.Tensor) -> torch.Tensor:
        return checkpoint(fn, h, use_reentrant=self.reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        if self.layout == "outside_then_inside":
            h = self.region(self.block, self.block(h))
        elif self.layout == "inside_then_outside":
            h = self.block(self.region(self.block, h))
        elif self.layout == "shared_block":
            for _ in range(3):
                h = self.region(self.block, h)
        elif self.layout == "sequential":
            layers = nn.Sequential(self.shared, nn.GELU(), self.shared, nn.GELU())
            h = checkpoint_sequential(layers, 2, h, use_reentrant=self.reentrant)
        else:
            h = self.region(lambda t: self.block(self.region(self.block, t)), self.block(h))
        return self.out(h)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(8 * STEPS, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    return [(x[i : i + 8].requires_grad_(), y[i : i + 8]) for i in range(0, len(x), 8)]


def _plugin(in_backward: bool) -> MixedPrecisionPlugin:
    # zero_grad_after_step=False: the Trainer's normal step then holds its gradients after the step, inside backward
    # each is freed by its update all the same
    return MixedPrecisionPlugin(
        "bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward, zero_grad_after_step=False
    )


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class Module(L.LightningModule):
    def __init__(self, layout: str, reentrant: bool) -> None:
        super().__init__()
        with seeded():
            self.net = Checkpointed(layout, reentrant)
        self.freed: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_train_batch_end(self, *args: Any) -> None:
        probe = min(self.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
        self.freed.append(all(p.grad is None for p in self.parameters() if p is not probe))

    def configure_optimizers(self) -> Any:
        return _optimizer(self.parameters())


def trainer_run(
    in_backward: bool, layout: str, reentrant: bool, path: Path, device: str = "cpu"
) -> tuple[dict, dict, list[bool]]:
    module = Module(layout, reentrant)
    x, y = map(torch.cat, zip(*_data()))
    trainer = make_trainer(_plugin(in_backward), max_steps=STEPS, accelerator=device)
    trainer.fit(module, DataLoader(TensorDataset(x.detach().requires_grad_(), y), batch_size=8))
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    return saved["state_dict"], saved["optimizer_states"][0]["state"], module.freed


def fabric_run(in_backward: bool, layout: str, reentrant: bool, path: Path) -> tuple[dict, dict, list[bool]]:
    with seeded():
        net = Checkpointed(layout, reentrant)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[_plugin(in_backward)])
    model, opt = fabric.setup(net, _optimizer(net.parameters()))
    freed = []
    for x, y in _data():
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        opt.step()
        probe = min(model.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
        freed.append(all(p.grad is None for p in model.parameters() if p is not probe))
        opt.zero_grad()
    fabric.save(path, {"model": model, "optimizer": opt})
    saved = torch.load(path, weights_only=True)
    return saved["model"], saved["optimizer"]["state"], freed


def _assert_same_bits(ours: tuple[dict, dict, Any], reference: tuple[dict, dict, Any]) -> None:
    weights, state, _ = ours
    assert weights.keys() == reference[0].keys() and weights
    for key, value in reference[0].items():
        assert value.dtype == torch.float32 and torch.equal(weights[key], value), key
    assert state.keys() == reference[1].keys() and state
    for index, expected in reference[1].items():
        assert state[index].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(state[index][key], value), (index, key)
        assert state[index]["step"].item() == STEPS  # each parameter updated once per step, no more


#: every layout reentrant under both loops; non-reentrant (no nested backward: exact before this rule) as a control
CASES = [(loop, layout, True) for loop in ("trainer", "fabric") for layout in LAYOUTS] + [
    ("fabric", layout, False) for layout in ("inside_then_outside", "shared_block", "sequential")
]


@pytest.mark.parametrize(("loop", "layout", "reentrant"), CASES)
def test_checkpointed_regions_update_each_parameter_once_bitwise_the_normal_lean_step(
    tmp_path, loop, layout, reentrant
):
    run = trainer_run if loop == "trainer" else fabric_run
    ours = run(True, layout, reentrant, tmp_path / "ours.ckpt")
    reference = run(False, layout, reentrant, tmp_path / "reference.ckpt")
    _assert_same_bits(ours, reference)
    assert ours[2] == [True] * STEPS  # every update ran inside backward: no gradient left at the step
    assert reference[2] == [False] * STEPS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["inside_then_outside", "shared_block"])
def test_on_cuda_reentrant_regions_update_each_parameter_once_bitwise_the_normal_lean_step(tmp_path, layout):
    """On CUDA autograd runs the backward (and the nested ones) on its device thread: the same rule, the same bits."""
    ours = trainer_run(True, layout, True, tmp_path / "ours.ckpt", "cuda")
    _assert_same_bits(ours, trainer_run(False, layout, True, tmp_path / "reference.ckpt", "cuda"))
    assert ours[2] == [True] * STEPS


def test_a_parameter_of_a_reentrant_region_waits_for_the_end_of_backward_and_others_do_not():
    """``inp`` (used before the region, outside it) gets its gradient after the region's nested backward finished:
    it is updated at once and its gradient freed inside backward; ``shared`` (inside and outside) waits."""
    with seeded():
        net = Checkpointed("outside_then_inside", reentrant=True)
    plugin = _plugin(True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(net, _optimizer(net.parameters()))
    seen: dict[str, Any] = {}

    def record(grad: torch.Tensor) -> torch.Tensor:  # the last gradient of the backward to arrive: `inp`'s input
        seen["inp"] = net.inp.weight.grad  # updated and freed once its hook ran, before this input gradient
        seen["shared"] = net.shared.weight.grad  # waiting: still held
        return grad

    x, y = _data()[0]
    x.register_hook(record)
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    assert seen["inp"] is None and seen["shared"] is not None
    probe = min(model.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
    assert all(p.grad is None for p in model.parameters() if p is not probe)  # the waiting ones ran at the end
    opt.step()


def test_reentrant_regions_under_a_reducing_strategy_are_refused_before_backward_updates_anything():
    """Under DDP and FSDP2 the gradients reach the updates through the strategy's reduction (one part per nested
    backward): refused in ``pre_backward``. The strategy's agreement is stood in by ``agree_each`` (what FSDP2 sets;
    the 2-rank runs in tests/distributed cover the strategies themselves)."""
    with seeded():
        net = Checkpointed("shared_block", reentrant=True)
    plugin = _plugin(True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(net, _optimizer(net.parameters()))
    plugin.steps.in_backward.agree_each = lambda flag: flag
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    x, y = _data()[0]
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert not opt.state


class SwitchedOn(Module):
    """Reentrant checkpointing (``layout``) switched on at step 2; before, the blocks run without a region. The walk
    before step 0 finds no region, so the later backwards are watched, not walked, until a hook runs inside a nested
    backward (in_backward_regions)."""

    def __init__(self, layout: str) -> None:
        super().__init__(layout, reentrant=True)
        self.target = layout

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.net.layout = self.target if self.trainer.global_step >= 2 else "plain"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.net.layout == "plain":
            out = self.net.out(self.net.block(self.net.block(self.net.inp(x))))
            return nn.functional.mse_loss(out.float(), y)
        return super().training_step(batch, batch_idx)


def _fit_switched(layout: str, in_backward: bool, path: Path) -> tuple[dict, dict]:
    trainer = make_trainer(_plugin(in_backward), max_steps=STEPS)
    trainer.fit(SwitchedOn(layout), DataLoader(TensorDataset(*map(torch.cat, zip(*_data()))), batch_size=8))
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    return saved["state_dict"], saved["optimizer_states"][0]["state"]


@pytest.mark.parametrize("layout", ["outside_then_inside", "shared_block", "sequential"])
def test_checkpointing_switched_on_mid_fit_is_followed_without_a_walk_before_every_backward(tmp_path, layout):
    weights, state = _fit_switched(layout, True, tmp_path / "ours.ckpt")
    reference_weights, reference_state = _fit_switched(layout, False, tmp_path / "reference.ckpt")
    assert weights.keys() == reference_weights.keys()
    assert all(torch.equal(weights[k], v) for k, v in reference_weights.items())
    assert state.keys() == reference_state.keys()
    assert all(torch.equal(state[i][k], v) for i, s in reference_state.items() for k, v in s.items())


def test_checkpointing_switched_on_mid_fit_around_a_parameter_updated_outside_first_raises(tmp_path):
    # inside_then_outside: `shared`'s outer part arrives, unwalked, before its region's part, and was updated already
    message = r"appeared in this backward after steps without it, and net\.(shared|norm)\.weight is used both"
    with pytest.raises(RuntimeError, match=message):
        _fit_switched("inside_then_outside", True, tmp_path / "ours.ckpt")
