"""The plugin under the standalone ``pytorch_lightning`` Trainer and ``lightning_fabric.Fabric``
(:mod:`lightning_mp.pytorch_lightning`, :mod:`lightning_mp.lightning_fabric`).

Every mode runs the same module code twice, once as a ``lightning.LightningModule`` under ``lightning.Trainer`` and
once as a ``pytorch_lightning.LightningModule`` under ``pytorch_lightning.Trainer``, and the two runs must end with
the same weights bit for bit (CPU runs are deterministic), the same learning rates and the same skipped steps. That
is what proves the standalone path *is* the plugin, not merely that it runs: a type question asked with only
``lightning``'s classes (Lightning's own ``Precision._clip_gradients``, the strategies' lookup) shows as a
difference. Each run has one batch with an inf in it (a skipped step: the step-interval scheduler must not advance),
and the clipping modes are checked to clip at all (their run differs from the same run without clipping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import lightning_fabric
import pytest
import pytorch_lightning as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp import lightning_fabric as mp_fabric
from lightning_mp import pytorch_lightning as mp_pl

INF_BATCH = 2  # the batch (of 4 per epoch) whose target holds an inf: a non-finite loss, a skipped step


def loader(inf_batch: int = INF_BATCH) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(16, 1, generator=gen)
    if inf_batch >= 0:
        y[4 * inf_batch, 0] = float("inf")
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


@dataclass(frozen=True)
class Mode:
    plugin: dict[str, Any]
    trainer: dict[str, Any] = field(default_factory=dict)
    manual: bool = False
    manual_clip: float = 0.0


MODES = {
    "bf16": Mode({"precision": "bf16-mixed"}),
    "bf16-masters": Mode({"precision": "bf16-mixed", "master_weights": True}),
    "bf16-remainder": Mode({"precision": "bf16-mixed", "master_weights": "remainder"}),
    "bf16-remainder-in-backward": Mode(
        {"precision": "bf16-mixed", "master_weights": "remainder", "optimizer_in_backward": True}
    ),
    "fp16-masters": Mode({"precision": "16-mixed", "master_weights": True}),
    "clip-norm-remainder": Mode(
        {"precision": "bf16-mixed", "master_weights": "remainder"}, {"gradient_clip_val": 0.05}
    ),
    "clip-value-fp16": Mode({"precision": "16-mixed"}, {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}),
    "accumulate-masters": Mode({"precision": "bf16-mixed", "master_weights": True}, {"accumulate_grad_batches": 2}),
    "manual-remainder-clip": Mode(
        {"precision": "bf16-mixed", "master_weights": "remainder"}, manual=True, manual_clip=0.05
    ),
    "manual-fp16": Mode({"precision": "16-mixed"}, manual=True),
}


class _Body:
    """The module's code, shared by its ``lightning`` and ``pytorch_lightning`` classes below."""

    def __init__(self, manual: bool = False, manual_clip: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.automatic_optimization = not manual
        self.manual_clip = manual_clip
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        if self.manual_clip:
            self.clip_gradients(optimizer, gradient_clip_val=self.manual_clip, gradient_clip_algorithm="norm")
        optimizer.step()
        self.lr_schedulers().step()
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LightningModel(_Body, L.LightningModule):
    pass


class StandaloneModel(_Body, pl.LightningModule):
    pass


PACKAGES = {
    "lightning": (L.Trainer, LightningModel, lightning_mp.MixedPrecisionPlugin, lightning_mp.PrecisionMonitor),
    "pytorch_lightning": (pl.Trainer, StandaloneModel, mp_pl.MixedPrecisionPlugin, mp_pl.PrecisionMonitor),
}


def fit(package: str, mode: Mode, max_epochs: int = 2, ckpt_path: Any = None, callbacks: Any = (), **trainer: Any):
    """One run of ``mode`` under ``package``'s Trainer; (module, plugin, trainer)."""
    trainer_class, model_class, plugin_class, _ = PACKAGES[package]
    plugin = plugin_class(**mode.plugin)
    model = model_class(mode.manual, mode.manual_clip)
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    options.update(enable_model_summary=False, deterministic=True, max_epochs=max_epochs, callbacks=list(callbacks))
    run = trainer_class(plugins=[plugin], **{**options, **mode.trainer, **trainer})
    run.fit(model, loader(), ckpt_path=ckpt_path)
    return model, plugin, run


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_run(ours: tuple, reference: tuple) -> None:
    (model, plugin, trainer), (ref_model, ref_plugin, ref_trainer) = ours, reference
    expected = weights(ref_model)
    assert expected and weights(model).keys() == expected.keys()
    for name, value in expected.items():
        assert value.dtype == torch.float32 and torch.equal(weights(model)[name], value), name
    # a resumed run records the learning rates of its own steps only: the end of the reference's
    assert model.lrs and model.lrs == ref_model.lrs[len(ref_model.lrs) - len(model.lrs) :]
    assert trainer.global_step == ref_trainer.global_step
    assert plugin.scaler.skipped_steps == ref_plugin.scaler.skipped_steps
    assert plugin.scaler.state_dict() == ref_plugin.scaler.state_dict()


@pytest.mark.parametrize("name", sorted(MODES))
def test_every_mode_under_pytorch_lightning_trains_bitwise_as_under_lightning(name):
    mode = MODES[name]
    reference = fit("lightning", mode)
    ours = fit("pytorch_lightning", mode)
    assert type(ours[2].precision_plugin) is mp_pl.MixedPrecisionPlugin
    assert_same_run(ours, reference)
    model, plugin, trainer = ours
    # the inf batch's step was skipped in each epoch (fp16: also the first steps' overflows while the scale backs
    # off), and the step-interval scheduler advanced on the other steps only
    assert (
        plugin.scaler.skipped_steps >= 2 if mode.plugin["precision"] == "16-mixed" else plugin.scaler.skipped_steps == 2
    )
    assert _decays(model.lrs[-1]) == trainer.global_step - plugin.scaler.skipped_steps
    assert all(torch.isfinite(value).all() for value in weights(model).values())
    if mode.trainer.get("gradient_clip_val") or mode.manual_clip:  # clipping bites: without it the run differs
        unclipped = Mode(mode.plugin, {k: v for k, v in mode.trainer.items() if "clip" not in k}, mode.manual)
        free = weights(fit("lightning", unclipped)[0])
        assert any(not torch.equal(free[key], value) for key, value in weights(model).items())


def _decays(lr: float) -> int:
    """How many times StepLR(gamma=0.8) has stepped from lr 0.05 to ``lr``."""
    return round(math.log(lr / 0.05) / math.log(0.8))


def test_the_standalone_plugin_serves_lightnings_trainer_too():
    mode = MODES["bf16-remainder"]
    model, plugin = LightningModel(), mp_pl.MixedPrecisionPlugin(**mode.plugin)
    trainer = L.Trainer(plugins=[plugin], accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False)
    trainer.fit(model, loader())
    assert_same_run((model, plugin, trainer), fit("lightning", mode))


def test_checkpoint_moves_between_packages_and_resumes_bitwise(tmp_path):
    mode = MODES["fp16-masters"]  # the scaler's state must come back too
    whole = fit("lightning", mode, max_epochs=2)
    _, _, first = fit("lightning", mode, max_epochs=1)
    path = tmp_path / "lightning.ckpt"
    first.save_checkpoint(path)
    assert "MixedPrecisionPlugin" in torch.load(path, weights_only=False)
    resumed = fit("pytorch_lightning", mode, max_epochs=2, ckpt_path=path)  # saved by lightning, resumed standalone
    assert_same_run(resumed, whole)
    _, _, first = fit("pytorch_lightning", mode, max_epochs=1)
    path = tmp_path / "standalone.ckpt"
    first.save_checkpoint(path)
    assert_same_run(fit("pytorch_lightning", mode, max_epochs=2, ckpt_path=path), whole)


def test_precision_monitor_under_pytorch_lightning_records_the_skips_and_writes_its_report(tmp_path):
    mode = MODES["fp16-masters"]
    monitors = {}
    for package in PACKAGES:
        monitors[package] = PACKAGES[package][3](sample_every=1)
        fit(package, mode, callbacks=[monitors[package]], default_root_dir=tmp_path / package)
    steps = [record.step for record in monitors["pytorch_lightning"].history.overflows]
    assert {INF_BATCH, 4 + INF_BATCH} <= set(steps)  # the inf batches' steps (fp16: the scale's first backoffs too)
    assert steps == [record.step for record in monitors["lightning"].history.overflows]
    assert len(monitors["pytorch_lightning"].history.samples) == len(monitors["lightning"].history.samples) > 0
    written = {path.name for path in (tmp_path / "pytorch_lightning").rglob("precision_*")}
    assert {"precision_report.md", "precision_diagnostics.json"} <= written


def test_lightnings_own_plugin_is_refused_by_pytorch_lightning_with_the_message_the_docs_name():
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="Found invalid type for plugin"):
        pl.Trainer(plugins=[lightning_mp.MixedPrecisionPlugin("bf16-mixed")], logger=False)
    with pytest.raises(TypeError, match="Found invalid type for plugin"):
        lightning_fabric.Fabric(plugins=[lightning_mp.MixedPrecisionPlugin("bf16-mixed")])
    with pytest.raises(MisconfigurationException, match="Found invalid type for plugin"):  # and the other way round
        L.Trainer(plugins=[lightning_fabric.plugins.precision.Precision()], logger=False)


def test_ddp_on_two_processes_under_pytorch_lightning_trains_bitwise_as_under_lightning(tmp_path):
    from tests.distributed.common import load_ranks
    from tests.distributed.launch import launch
    from tests.distributed.standalone_checks import DDP_MODES

    launch("standalone_checks.py", str(tmp_path), timeout=240)
    for rank, results in enumerate(load_ranks(tmp_path)):
        for name in DDP_MODES:
            ours, reference = results[name, "pytorch_lightning"], results[name, "lightning"]
            assert ours["world_size"] == reference["world_size"] == 2, (rank, name)
            assert ours["sync"] == reference["sync"] == "DDPSync", (rank, name)  # the plugin knew the strategy
            assert ours["lrs"] == reference["lrs"] and ours["skipped"] == reference["skipped"] == 2, (rank, name)
            assert reference["weights"]
            for key, value in reference["weights"].items():
                assert torch.equal(ours["weights"][key], value), (rank, name, key)


# ---------------------------------------------------------------------------------------------------- Fabric
def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def fabric_run(
    fabric_class: Any, plugin: Any, tmp_path: Any, in_backward: bool = False, monitor: Any = None
) -> dict[str, torch.Tensor]:
    """4 Fabric steps (one with an inf batch), clipping by value through ``fabric.clip_gradients`` unless the step
    runs in backward, a save after step 2 and a load into a fresh model: the loaded model's final weights."""
    callbacks = [monitor] if monitor is not None else []
    fabric = fabric_class(accelerator="cpu", devices=1, plugins=[plugin], callbacks=callbacks)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    for index, batch in enumerate(loader()):
        fabric.call("on_train_batch_start", batch=batch, batch_idx=index)
        fabric.backward(_loss(model, batch))
        if not in_backward:
            fabric.clip_gradients(model, optimizer, clip_val=0.05)
        optimizer.step()
        optimizer.zero_grad()
        if index == 1:
            fabric.save(tmp_path / "state.ckpt", {"model": model, "optimizer": optimizer})
    fabric.call("on_train_end")
    skipped = plugin.scaler.skipped_steps
    assert skipped >= 1 if plugin.precision == "16-mixed" else skipped == 1  # fp16: the scale's first backoffs too
    state = {"model": model, "optimizer": optimizer}
    fabric.load(tmp_path / "state.ckpt", state)  # the masters and the scaler come back as they were after step 2
    scale = plugin.scaler.state_dict()["scale"] * torch.ones(())
    return {**weights(model), "scale": scale, "skipped": torch.tensor(skipped)}


@pytest.mark.parametrize(
    "options",
    [
        {"precision": "bf16-mixed", "master_weights": "remainder"},
        {"precision": "16-mixed", "master_weights": True},
        {"precision": "bf16-mixed", "master_weights": "remainder", "optimizer_in_backward": True},
    ],
    ids=["bf16-remainder", "fp16-masters", "bf16-remainder-in-backward"],
)
@pytest.mark.parametrize("plugin_class", [mp_fabric.MixedPrecisionPlugin, mp_pl.MixedPrecisionPlugin])
def test_lightning_fabric_trains_bitwise_as_lightnings_fabric(options, plugin_class, tmp_path):
    in_backward = options.get("optimizer_in_backward", False)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference = fabric_run(L.Fabric, lightning_mp.MixedPrecisionPlugin(**options), tmp_path / "a", in_backward)
    ours = fabric_run(lightning_fabric.Fabric, plugin_class(**options), tmp_path / "b", in_backward)
    assert ours.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(ours[name], value), name


def test_fabric_precision_monitor_under_lightning_fabric_records_as_under_lightnings_fabric(tmp_path):
    options = {"precision": "bf16-mixed", "master_weights": "remainder"}
    steps = {}
    for name, fabric_class, plugin_class in (
        ("lightning", L.Fabric, lightning_mp.MixedPrecisionPlugin),
        ("lightning_fabric", lightning_fabric.Fabric, mp_fabric.MixedPrecisionPlugin),
    ):
        (tmp_path / name).mkdir()
        monitor = mp_fabric.FabricPrecisionMonitor(loss_fn=_loss, log_dir=tmp_path / name, sample_every=1)
        fabric_run(fabric_class, plugin_class(**options), tmp_path / name, monitor=monitor)
        steps[name] = [record.step for record in monitor.monitor.history.overflows]
        assert (tmp_path / name / "precision_report.md").exists(), name
    assert steps["lightning_fabric"] == steps["lightning"] == [INF_BATCH]


def test_audit_of_a_pytorch_lightning_module_runs_its_training_step_as_lightnings():
    batch = next(iter(loader(inf_batch=-1)))
    censuses = {}
    for package in PACKAGES:
        model = PACKAGES[package][1]()
        plugin = PACKAGES[package][2]("bf16-mixed")
        censuses[package] = mp_pl.audit(model, batch, context=plugin.autocast_context_manager())
    rows = {
        package: [(row.op, row.phase, row.module, row.dtype) for row in census.rows]
        for package, census in censuses.items()
    }
    assert rows["pytorch_lightning"] == rows["lightning"] and any(row[1] == "backward" for row in rows["lightning"])
    assert censuses["pytorch_lightning"].half_flops_fraction() == censuses["lightning"].half_flops_fraction() > 0
