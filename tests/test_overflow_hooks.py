"""An inf injected by a forward hook (outside the module's own forward) is localised at the hooked module, at the op
that made the first non-finite value, not where a following norm turns it into NaN (issue 25, item 5: HF Llama, a
hook on ``layers.1.mlp.down_proj`` multiplying its output by inf, was reported at ``model.norm``, op ``mul``)."""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin, PrecisionMonitor
from lightning_mp.diagnostics.nonfinite import NonFiniteTrace
from tests.helpers import make_trainer, seeded


class RMSNorm(nn.Module):
    """Llama's norm: an inf in its input becomes NaN (inf * rsqrt(inf) = inf * 0)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.block, self.norm, self.head = nn.Linear(4, 8), Block(), RMSNorm(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.inp(x))))


def test_an_inf_from_a_forward_hook_is_born_in_the_hooked_module_not_in_the_norm_that_makes_it_nan():
    with seeded():
        net = Net()
    net.block.down.register_forward_hook(lambda module, args, output: output * float("inf"))
    with NonFiniteTrace(net, torch.device("cpu")) as trace:
        loss = net(torch.randn(2, 4)).pow(2).mean()
    assert torch.isnan(loss)
    origin = trace.origin([loss])
    assert (origin.phase, origin.module, origin.module_class, origin.op) == ("forward", "block.down", "Linear", "mul")


def test_code_in_a_forward_pre_hook_belongs_to_the_hooked_module():
    with seeded():
        net = Net()
    net.norm.register_forward_pre_hook(lambda module, args: (args[0] * 1e39,))
    with NonFiniteTrace(net, torch.device("cpu")) as trace:
        loss = net(torch.randn(2, 4)).pow(2).mean()
    origin = trace.origin([loss])
    assert (origin.module, origin.module_class, origin.op) == ("norm", "RMSNorm", "mul")


class HookedModule(L.LightningModule):
    """At step 1 a forward hook on ``net.block.down`` multiplies its output by inf (as in the issue)."""

    def __init__(self) -> None:
        super().__init__()
        with seeded():
            self.net = Net()
        self.net.block.down.register_forward_hook(self._inject)

    def _inject(self, module: nn.Module, args: Any, output: torch.Tensor) -> Any:
        return output * float("inf") if self.trainer.global_step == 1 else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_the_monitor_reports_the_hooked_module_and_its_op_bf16_with_lean_masters(tmp_path):
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    monitor = PrecisionMonitor(localise_overflows=True)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(plugin, callbacks=[monitor], max_steps=3, default_root_dir=tmp_path).fit(
            HookedModule(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
        )
    assert monitor.history.skipped == [1]
    (record,) = monitor.history.overflows
    assert (record.step, record.phase, record.module, record.module_class, record.op) == (
        1,
        "forward",
        "net.block.down",
        "Linear",
        "mul",
    )


def test_fabric_precision_monitor_localises_samples_and_reports_from_a_fabric_loop(tmp_path):
    """The few lines of docs/fabric.md: the skipped step is replayed through ``loss_fn`` and localised at the hooked
    module's ``mul``; gradients are sampled; the report is written."""
    from lightning_mp.diagnostics import FabricPrecisionMonitor

    state = {"step": 0}
    with seeded():
        net = Net()
    net.block.down.register_forward_hook(lambda m, a, out: out * float("inf") if state["step"] == 1 else None)

    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x).float(), y)

    monitor = FabricPrecisionMonitor(loss_fn, log_dir=tmp_path, sample_every=1)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin], callbacks=[monitor])
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
    x = torch.randn(24, 4, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(3):
            state["step"] = index
            batch = (x[8 * index : 8 * index + 8], x[8 * index : 8 * index + 8].sum(1, keepdim=True))
            fabric.call("on_train_batch_start", batch=batch, batch_idx=index)
            fabric.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
        fabric.call("on_train_end")
    assert monitor.history.skipped == [1] and monitor.history.steps == 3
    (record,) = monitor.history.overflows
    assert (record.step, record.phase, record.module, record.module_class, record.op) == (
        1,
        "forward",
        "block.down",
        "Linear",
        "mul",
    )
    assert len(monitor.history.samples) == 3 and "block.down" in monitor.history.samples[0].layers
    assert (tmp_path / "precision_report.md").exists()
    assert monitor._on_skip not in plugin.skip_observers
