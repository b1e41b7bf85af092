"""``optimizer_in_backward=True`` under Lightning Fabric and the Trainer's manual optimization: the backward
(``fabric.backward``, ``self.manual_backward``) performs the updates, ``optimizer.step()`` keeps the books.

The reference of every run is the same loop with the normal lean step (``optimizer_in_backward=False``), same model,
data and seed: the fp32 weights as saved (``fabric.save``, ``trainer.save_checkpoint``) and the optimizer state must
be the same bits.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

OPTIMIZERS = ("adamw", "adam", "sgd")
LOOPS = ("fabric", "manual")


def build() -> nn.Module:
    """Linear (bf16 + remainder: bf16 gradients) -> LayerNorm (kept fp32: fp32 gradients) -> GELU -> Linear."""
    with seeded():
        return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))


def make_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.01, amsgrad=True)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    return [(x[i : i + 8], x[i : i + 8].sum(1, keepdim=True)) for i in range(0, 48, 8)]


def plugin_for(in_backward: bool) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)


class Run:
    """One run's record: per step whether every gradient was ``None`` after backward and after the step, the LR."""

    def __init__(self, bad_loss_at: int = -1, bad_grad_at: int = -1) -> None:
        self.bad_loss_at, self.bad_grad_at, self.step = bad_loss_at, bad_grad_at, 0
        self.freed_after_backward: list[bool] = []
        self.freed_after_step: list[bool] = []
        self.lrs: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}
        self.optimizer_state: dict[int, dict[str, torch.Tensor]] = {}

    def watch(self, net: nn.Module) -> None:
        """An inf in ``net[3].weight``'s gradient at step ``bad_grad_at``, before autograd accumulates it."""
        net[3].weight.register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if self.step == self.bad_grad_at:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    def loss(self, net: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(net(x).float(), y)
        return loss * float("nan") if self.step == self.bad_loss_at else loss

    def after(self, params: Any, stage: str) -> None:
        params = list(params)
        probe = min(
            params, key=torch.Tensor.numel
        )  # its gradient kept: the probe of zero_grad (in_backward_zero_grads)
        getattr(self, f"freed_after_{stage}").append(all(p.grad is None for p in params if p is not probe))


def fabric_run(
    in_backward: bool,
    path: Path,
    optimizer: str = "adamw",
    steps: int = 4,
    run: Optional[Run] = None,
    scheduler: bool = False,
    resume: Optional[Path] = None,
) -> Run:
    """A Fabric loop as users write it (``fabric.backward``, ``step``, ``zero_grad``, the scheduler given to
    ``fabric.setup``); from ``resume`` (a ``fabric.save`` of such a run) when given; saved to ``path`` at the end."""
    run = run or Run()
    net = build()
    run.watch(net)
    opt = make_optimizer(net.parameters(), optimizer)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin_for(in_backward)])
    state: dict[str, Any] = {}
    if scheduler:
        state["scheduler"] = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        state["model"], state["optimizer"], state["scheduler"] = fabric.setup(net, opt, scheduler=state["scheduler"])
    else:
        state["model"], state["optimizer"] = fabric.setup(net, opt)
    model, opt = state["model"], state["optimizer"]
    start = fabric.load(resume, state)["step"] if resume is not None else 0
    for run.step, (x, y) in list(enumerate(data()))[start:steps]:
        fabric.backward(run.loss(model, x, y))
        run.after(model.parameters(), "backward")
        opt.step()
        run.after(model.parameters(), "step")
        if scheduler:
            state["scheduler"].step()
        run.lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
    fabric.save(path, {**state, "step": steps})
    saved = torch.load(path, weights_only=True)
    run.weights, run.optimizer_state = saved["model"], saved["optimizer"]["state"]
    return run


class Manual(L.LightningModule):
    """Manual optimization: ``self.manual_backward(loss)``, ``opt.step()``, ``opt.zero_grad()``, ``sch.step()``."""

    def __init__(self, optimizer: str, run: Run, scheduler: bool = False, inside: Any = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net, self.optimizer_name, self.run = build(), optimizer, run
        self.scheduler, self.inside = scheduler, inside
        run.watch(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        self.run.step = batch_idx
        self.manual_backward(self.run.loss(self.net, *batch))
        self.run.after(self.parameters(), "backward")
        if self.inside is not None:  # what a test does between backward and step
            self.inside(self, opt, batch)
        opt.step()
        self.run.after(self.parameters(), "step")
        if self.scheduler:
            self.lr_schedulers().step()
        self.run.lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.parameters(), self.optimizer_name)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)  # interval "step": held on a skip
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def manual_run(
    in_backward: bool, path: Path, optimizer: str = "adamw", steps: int = 4, run: Optional[Run] = None, **kw: Any
) -> Run:
    run = run or Run()
    loader = DataLoader(TensorDataset(*map(torch.cat, zip(*data()))), batch_size=8)
    trainer = make_trainer(plugin_for(in_backward), max_steps=steps)
    trainer.fit(Manual(optimizer, run, **kw), loader)
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=True)
    run.weights = {key.removeprefix("net."): value for key, value in saved["state_dict"].items()}
    run.optimizer_state = saved["optimizer_states"][0]["state"]
    return run


RUNS = {"fabric": fabric_run, "manual": manual_run}


def assert_same_bits(ours: Run, reference: Run) -> None:
    assert ours.weights.keys() == reference.weights.keys() and ours.weights
    for key, value in reference.weights.items():
        assert value.dtype == torch.float32 and torch.equal(ours.weights[key], value), key
    assert ours.optimizer_state.keys() == reference.optimizer_state.keys() and ours.optimizer_state
    for index, state in reference.optimizer_state.items():
        assert ours.optimizer_state[index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(ours.optimizer_state[index][key], value), (index, key)


# ---------------------------------------------------------------------- the same numbers
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("loop", LOOPS)
def test_backward_performs_the_updates_bitwise_the_normal_lean_step_and_frees_the_gradients(tmp_path, loop, optimizer):
    ours = RUNS[loop](True, tmp_path / "ours.ckpt", optimizer)
    reference = RUNS[loop](False, tmp_path / "reference.ckpt", optimizer)
    assert_same_bits(ours, reference)
    assert ours.freed_after_backward == ours.freed_after_step == [True] * 4  # used and freed inside backward
    assert reference.freed_after_backward == [False] * 4  # the normal step holds them until the step


def test_under_fabric_the_backward_updates_and_the_step_changes_no_weight(tmp_path):
    net = build()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    plugin = plugin_for(True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(net, opt)
    x, y = data()[0]
    before = [plugin.masters.fp32_value(p).clone() for p in net.parameters()]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    after_backward = [plugin.masters.fp32_value(p).clone() for p in net.parameters()]
    assert not any(torch.equal(a, b) for a, b in zip(before, after_backward))  # every parameter was updated
    opt.step()
    opt.zero_grad()  # harmless: nothing is left to zero
    assert all(torch.equal(a, plugin.masters.fp32_value(p)) for a, p in zip(after_backward, net.parameters()))
    assert opt.state[net[0].weight]["step"].item() == 1


# ---------------------------------------------------------------------- non-finite values
@pytest.mark.parametrize("loop", LOOPS)
def test_a_nan_loss_skips_every_update_and_the_scheduler_holds(tmp_path, loop):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step\\(\\)")  # torch's "before optimizer.step()"
        ours = RUNS[loop](True, tmp_path / "ours.ckpt", run=Run(bad_loss_at=2), scheduler=True)
    reference = RUNS[loop](False, tmp_path / "reference.ckpt", run=Run(bad_loss_at=2), scheduler=True)
    assert_same_bits(ours, reference)
    assert ours.lrs == reference.lrs == [5e-3, 2.5e-3, 2.5e-3, 1.25e-3]  # held on step 2
    # step 2 changed nothing: the state after 3 steps is the state after 2 steps that ran (step counts too)
    three = RUNS[loop](True, tmp_path / "three.ckpt", run=Run(bad_loss_at=2), steps=3)
    two = RUNS[loop](True, tmp_path / "two.ckpt", steps=2)
    assert_same_bits(three, two)


@pytest.mark.parametrize("loop", LOOPS)
def test_an_inf_gradient_skips_only_its_parameter_with_a_warning(tmp_path, loop):
    with pytest.warns(UserWarning, match=r"non-finite gradients in 1 parameter\(s\) \((net\.)?3\.weight\)"):
        ours = RUNS[loop](True, tmp_path / "ours.ckpt", run=Run(bad_grad_at=1), steps=2)
    one, two = RUNS[loop](True, tmp_path / "one.ckpt", steps=1), RUNS[loop](True, tmp_path / "two.ckpt", steps=2)
    index = list(dict(build().named_parameters())).index("3.weight")
    for key, value in ours.weights.items():
        expected = one if key == "3.weight" else two  # that parameter as after step 1, the others stepped
        assert torch.equal(value, expected.weights[key]), key
    for i, state in ours.optimizer_state.items():
        for key, value in state.items():
            assert torch.equal(value, (one if i == index else two).optimizer_state[i][key]), (i, key)


# ---------------------------------------------------------------------- checkpoints under Fabric
@pytest.mark.parametrize(("first", "then"), [(True, True), (True, False), (False, True)])
def test_fabric_checkpoints_resume_bit_exactly_and_move_between_modes(tmp_path, first, then):
    whole = fabric_run(False, tmp_path / "whole.ckpt", scheduler=True)
    fabric_run(first, tmp_path / "first.ckpt", steps=2, scheduler=True)
    resumed = fabric_run(then, tmp_path / "resumed.ckpt", scheduler=True, resume=tmp_path / "first.ckpt")
    assert_same_bits(resumed, whole)  # the scheduler's rate after the load reaches the updates inside backward
    assert resumed.lrs == whole.lrs[2:]


# ---------------------------------------------------------------------- what the loop may do and may not
def _fabric(optimizers: int = 1) -> tuple[L.Fabric, nn.Module, Any, MixedPrecisionPlugin]:
    net = build()
    plugin = plugin_for(True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    return fabric, model, opt, plugin


def test_fabric_a_second_backward_before_the_step_is_refused_before_it_updates_anything():
    fabric, model, opt, plugin = _fabric()
    (x, y), (x2, y2) = data()[:2]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    values = [plugin.masters.fp32_value(p).clone() for p in model.parameters()]
    message = r"optimizer_in_backward=True\) .*one backward per optimizer step.*no_backward_sync"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Fabric: no_backward_sync does nothing on one device
        with fabric.no_backward_sync(model), pytest.raises(RuntimeError, match=message):
            fabric.backward(nn.functional.mse_loss(model(x2), y2))
    assert all(torch.equal(v, plugin.masters.fp32_value(p)) for v, p in zip(values, model.parameters()))
    probe = min(model.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
    assert all(p.grad is None for p in model.parameters() if p is not probe)


@pytest.mark.parametrize(("clip", "message"), [({"max_norm": 1.0}, "by norm"), ({"clip_val": 0.1}, "by value")])
def test_fabric_clip_gradients_after_backward_is_refused_naming_the_option(clip, message):
    fabric, model, opt, _ = _fabric()
    x, y = data()[0]
    fabric.backward(nn.functional.mse_loss(model(x), y))
    expected = rf"optimizer_in_backward=True\) cannot clip {message} after backward \(fabric.clip_gradients\("
    with pytest.raises(RuntimeError, match=expected + r".*optimizer_in_backward=False"):
        fabric.clip_gradients(model, opt, **clip)


def test_fabric_several_optimizers_are_refused_at_setup():
    net = build()
    first, second = torch.optim.AdamW(net[0].parameters()), torch.optim.AdamW(net[1:].parameters())
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin_for(True)])
    with pytest.raises(ValueError, match=r"optimizer_in_backward=True\) takes exactly one optimizer, got 2"):
        fabric.setup(net, first, second)
    net = build()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin_for(True)])
    model = fabric.setup_module(net)
    fabric.setup_optimizers(torch.optim.AdamW(net[0].parameters()))
    with pytest.raises(ValueError, match=r"takes exactly one optimizer, got 2"):
        fabric.setup_optimizers(torch.optim.AdamW(net[1:].parameters()))
    assert model is not None


def test_manual_a_second_manual_backward_before_the_step_is_refused_before_it_updates_anything(tmp_path):
    seen: dict[str, Any] = {}

    def second_backward(module: Manual, opt: Any, batch: Any) -> None:
        masters = module.trainer.precision_plugin.masters
        seen["values"] = [masters.fp32_value(p).clone() for p in module.parameters()]
        module.manual_backward(module.run.loss(module.net, *batch))

    model = Manual("adamw", Run(), inside=second_backward)
    with pytest.raises(RuntimeError, match=r"one backward per optimizer step.*manual_backward"):
        make_trainer(plugin_for(True), max_steps=2).fit(model, DataLoader(TensorDataset(*data()[0]), batch_size=8))
    # teardown gave the model its fp32 values: those of the first backward's updates, the second updated nothing
    assert all(torch.equal(v, p) for v, p in zip(seen["values"], model.parameters()))


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_manual_clip_gradients_after_backward_is_refused_naming_the_option(algorithm):
    def clip(module: Manual, opt: Any, batch: Any) -> None:
        module.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm=algorithm)

    model = Manual("adamw", Run(), inside=clip)
    message = rf"cannot clip by {algorithm} after backward \(self.clip_gradients\)"
    with pytest.raises(RuntimeError, match=message + r".*optimizer_in_backward=False"):
        make_trainer(plugin_for(True), max_steps=1).fit(model, DataLoader(TensorDataset(*data()[0]), batch_size=8))


def test_manual_several_optimizers_are_refused_before_any_step():
    class Two(Manual):
        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.net[0].parameters()), torch.optim.AdamW(self.net[1:].parameters())

    run = Run()
    with pytest.raises(ValueError, match=r"optimizer_in_backward=True\) takes exactly one optimizer, got 2"):
        make_trainer(plugin_for(True), max_steps=1).fit(Two("adamw", run), DataLoader(TensorDataset(*data()[0])))
    assert run.freed_after_backward == []


def test_automatic_a_custom_configure_gradient_clipping_by_norm_is_refused_but_the_trainers_value_clip_runs(tmp_path):
    class Automatic(L.LightningModule):
        def __init__(self, custom: bool) -> None:
            super().__init__()
            self.net, self.custom = build(), custom

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.net(batch[0]).float(), batch[1])

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any, gradient_clip_algorithm: Any):
            if self.custom:
                self.clip_gradients(optimizer, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
            else:
                super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    loader = DataLoader(TensorDataset(*data()[0]), batch_size=8)
    with pytest.raises(RuntimeError, match=r"cannot clip by norm after backward \(self.clip_gradients\)"):
        make_trainer(plugin_for(True), max_steps=1).fit(Automatic(True), loader)
    trainer = make_trainer(plugin_for(True), max_steps=1, gradient_clip_val=0.5, gradient_clip_algorithm="value")
    trainer.fit(Automatic(False), loader)  # the Trainer's value clip: applied inside backward, nothing raised
    assert trainer.global_step == 1


def test_fabric_precision_monitor_records_skips_inside_backward_and_names_the_skipped_parameter(tmp_path):
    # fabric.backward performs the updates; optimizer.step() hands a step with a skipped update to the monitor, whose
    # record names the parameter (its gradient is gone by then) and whose replay of a NaN loss finds it in the forward
    from lightning_mp.diagnostics import FabricPrecisionMonitor

    net = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 1))
    state = {"step": 0}
    net[3].weight.register_hook(lambda g: g.clone().fill_(float("inf")) if state["step"] == 1 else g)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(model(x).float(), y)
        return loss * float("nan") if state["step"] == 2 else loss

    monitor = FabricPrecisionMonitor(loss_fn, log_dir=tmp_path, sample_every=1000)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], callbacks=[monitor])
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(4):
            state["step"] = index
            batch = (x[8 * index : 8 * index + 8], x[8 * index : 8 * index + 8].sum(1, keepdim=True))
            fabric.call("on_train_batch_start", batch=batch, batch_idx=index)
            fabric.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        fabric.call("on_train_end")
    assert monitor.history.skipped == [1, 2] and monitor.history.steps == 4
    partial, whole = monitor.history.overflows
    assert partial.nonfinite_params == ["3.weight"] and "only these parameters' updates" in partial.note
    assert whole.nonfinite_params == [] and whole.phase == "forward"
