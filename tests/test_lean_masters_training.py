"""Lean master weights through a Trainer: the plugin's step, accumulation, clipping, skips, checkpoints, resume.

The reference for a run is a replay of the gradients it saw (recorded in ``on_before_optimizer_step``, before
clipping) on fp32 parameters with torch's fused optimizer and torch's clipping: the lean run must end bitwise there.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master import RemainderMasters
from tests.helpers import make_trainer, seeded
from tests.optimizer_edits import eight_bit_runs


class Net(L.LightningModule):
    """Linear -> LayerNorm (kept fp32) -> GELU -> Linear; records the gradients each step sees."""

    def __init__(self, optimizer: str = "adamw", inject_inf_at: tuple[int, ...] = (), scheduler: bool = False) -> None:
        super().__init__()
        width = 256 if optimizer == "adamw8bit" else 32  # torchao's 8-bit moments from 4096 elements: 16 x 256
        self.net = nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1))
        self.optimizer_name, self.inject_inf_at, self.scheduler = optimizer, set(inject_inf_at), scheduler
        self.seen: list[list[torch.Tensor]] = []
        self.lrs: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inject_inf_at:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.seen.append([p.grad.detach().clone() for p in self.parameters()])

    def on_train_batch_end(self, *args: Any) -> None:
        self.lrs.append(float(self.trainer.optimizers[0].param_groups[0]["lr"]))  # (torchao: a tensor)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adamw":
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        elif self.optimizer_name == "adamw8bit":  # torchao's, in one pass on lean masters
            from torchao.optim import AdamW8bit

            optimizer = AdamW8bit(self.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


EIGHT_BIT = pytest.mark.skipif(not eight_bit_runs(), reason="torchao is not installed or the 8-bit kernel is not built")


def _loader(n: int = 64) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _replay(initial: list[torch.Tensor], seen: list[list[torch.Tensor]], optimizer: str, clip: Any) -> list:
    params = [nn.Parameter(p.clone()) for p in initial]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    elif optimizer == "adamw8bit":  # torchao's own (compiled) step on fp32 parameters
        from torchao.optim import AdamW8bit

        opt = AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True, fused=True)
    for grads in seen:
        if not all(torch.isfinite(g).all() for g in grads):
            continue  # the plugin skipped this step
        for param, grad in zip(params, grads):
            param.grad = grad.float()
        if clip is not None:
            algorithm, value = clip
            if algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, value)
            else:
                torch.nn.utils.clip_grad_value_(params, value)
        opt.step()
    return [p.detach() for p in params]


@pytest.mark.parametrize(
    ("optimizer", "accumulate", "clip", "inject"),
    [
        ("adamw", 1, None, ()),
        ("adamw", 2, ("norm", 0.5), ()),
        ("adamw", 1, ("value", 0.05), ()),
        ("sgd", 2, ("norm", 0.01), ()),
        ("adamw", 1, ("norm", 0.5), (2, 3)),
        pytest.param("adamw8bit", 1, None, (), marks=EIGHT_BIT),
        pytest.param("adamw8bit", 2, ("norm", 0.5), (), marks=EIGHT_BIT),
        pytest.param("adamw8bit", 1, ("value", 0.05), (), marks=EIGHT_BIT),
        pytest.param("adamw8bit", 2, ("norm", 0.5), (2, 3), marks=EIGHT_BIT),
    ],
)
def test_trainer_run_equals_its_gradients_replayed_on_fp32_bitwise(optimizer, accumulate, clip, inject):
    """With ``inject``, those steps' gradients hold an inf: skipped, and their clipping must not leak into the next.
    ``adamw8bit``: torchao's AdamW8bit in one pass (8-bit moments for the 16 x 256 weight), replayed with torchao's own
    optimizer."""
    with seeded():
        model = Net(optimizer, inject_inf_at=inject)
    initial = [p.detach().clone() for p in model.parameters()]
    kwargs: dict[str, Any] = dict(accumulate_grad_batches=accumulate)
    if clip is not None:
        kwargs.update(gradient_clip_val=clip[1], gradient_clip_algorithm=clip[0])
    make_trainer(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"), **kwargs).fit(model, _loader())
    assert len(model.seen) == 8 // accumulate
    # gradients at rest are bf16; accumulated over micro-batches they are fp32 (exact sums)
    expected = torch.float32 if accumulate > 1 else torch.bfloat16
    assert model.seen[0][0].dtype == expected and model.seen[0][2].dtype == torch.float32  # LayerNorm: fp32
    for final, replayed in zip(model.parameters(), _replay(initial, model.seen, optimizer, clip)):
        assert final.dtype == torch.float32 and torch.equal(final, replayed)


class ManualNet(Net):
    """:class:`Net` under manual optimization: a step every second batch, the gradients clipped by norm first."""

    def __init__(self, optimizer: str) -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x).float(), y))
        if batch_idx % 2 == 1:
            optimizer = self.optimizers()
            self.seen.append([p.grad.detach().clone() for p in self.parameters()])
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass  # the gradients are recorded before clip_gradients (above)


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adamw8bit", marks=EIGHT_BIT)])
def test_manual_optimization_with_accumulation_and_clipping_equals_its_gradients_replayed_bitwise(optimizer):
    """Manual optimization (``manual_backward`` twice, ``clip_gradients`` by norm, ``optimizer.step()``), torch's AdamW
    and torchao's AdamW8bit in one pass: the same bits as the gradients replayed on fp32 parameters."""
    with seeded():
        model = ManualNet(optimizer)
    initial = [p.detach().clone() for p in model.parameters()]
    make_trainer(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")).fit(model, _loader())
    assert len(model.seen) == 4 and model.seen[0][0].dtype == torch.float32  # accumulated: exact fp32 sums
    for final, replayed in zip(model.parameters(), _replay(initial, model.seen, optimizer, ("norm", 0.5))):
        assert final.dtype == torch.float32 and torch.equal(final, replayed)


def test_bf16_accumulation_is_an_explicit_option():
    with seeded():
        model = Net()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights={"kind": "remainder", "accumulate_grads_in": "bf16"})
    make_trainer(plugin, accumulate_grad_batches=2).fit(model, _loader())
    assert model.seen[0][0].dtype == torch.bfloat16  # autograd added the micro-batches in bf16


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adamw8bit", marks=EIGHT_BIT)])
def test_skipped_step_changes_nothing_and_holds_the_scheduler(optimizer):
    """A skipped step (an inf in a gradient) changes no weight, remainder or step count, and the LR scheduler does not
    advance on it; torchao's AdamW8bit in one pass too (its lr a tensor the scheduler fills in place)."""
    with seeded():
        model = Net(optimizer, inject_inf_at=(2,), scheduler=True)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")

    class Snapshot(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 2:
                self.before = {n: p.detach().clone() for n, p in module.named_parameters()}
                self.remainders = [low.clone() for _, low in trainer.precision_plugin.masters.flat_buffers]

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 2:
                self.after = {n: p.detach().clone() for n, p in module.named_parameters()}
                self.remainders_after = [low.clone() for _, low in trainer.precision_plugin.masters.flat_buffers]

    snapshot = Snapshot()
    trainer = make_trainer(plugin, callbacks=[snapshot])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, _loader())
    # the lean step is not optimizer.step(), yet torch's scheduler must see that the optimizer stepped first
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    assert plugin.scaler.skipped_steps == 1
    assert all(torch.equal(snapshot.before[n], snapshot.after[n]) for n in snapshot.before)
    assert all(torch.equal(a, b) for a, b in zip(snapshot.remainders, snapshot.remainders_after))
    assert model.lrs[1] == model.lrs[2] == model.lrs[0] / 2  # the scheduler did not advance on the skipped step
    assert trainer.optimizers[0].state[model.net[0].weight]["step"].item() == 7


# ---------------------------------------------------------------------- the parts of the model
class Tied(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 20, bias=False)
        self.head.weight = self.embed.weight

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.head(self.norm(self.embed(tokens))).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_tied_parameters_have_one_remainder_and_checkpoints_hold_fp32_under_both_names(tmp_path):
    with seeded():
        model = Tied()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    loader = DataLoader(TensorDataset(torch.randint(0, 20, (32, 6))), batch_size=8)
    trainer = make_trainer(plugin, max_steps=3)
    seen = {}

    class Grab(L.Callback):
        def on_train_end(self, trainer, module):
            masters = trainer.precision_plugin.masters
            seen["flat"] = sum(high.numel() for high, _ in masters.flat_buffers)
            seen["value"] = masters.fp32_value(module.embed.weight).clone()
            seen["norm"] = module.norm.weight.dtype
            trainer.save_checkpoint(tmp_path / "tied.ckpt")

    trainer.callbacks.append(Grab())
    trainer.fit(model, loader)
    assert seen["flat"] == 20 * 16  # the tied matrix once; the LayerNorm (fp32) has no remainder
    assert seen["norm"] == torch.float32
    state = torch.load(tmp_path / "tied.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(state["embed.weight"], seen["value"]) and torch.equal(state["head.weight"], seen["value"])
    plain = Tied()
    plain.load_state_dict(state, strict=True)
    assert torch.equal(plain.embed.weight, seen["value"])


def test_cast_policy_fp32_modules_stay_fp32_without_remainder():
    with seeded():
        model = Net()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", policy={"fp32_modules": ["net.3"]})
    dtypes = {}

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            dtypes.update({n: p.dtype for n, p in module.named_parameters()})
            dtypes["flat"] = sum(h.numel() for h, _ in trainer.precision_plugin.masters.flat_buffers)

    make_trainer(plugin, max_steps=1, callbacks=[Look()]).fit(model, _loader())
    assert dtypes["net.0.weight"] == torch.bfloat16
    assert dtypes["net.3.weight"] == dtypes["net.1.weight"] == torch.float32
    assert dtypes["flat"] == 16 * 32 + 32


# ---------------------------------------------------------------------- checkpoints and resume
def test_resume_from_a_checkpoint_reproduces_the_uninterrupted_run_bit_exactly(tmp_path):
    def run(max_epochs, seed, ckpt=None):
        with seeded(seed):
            model = Net(inject_inf_at=(5, 13), scheduler=True)
        trainer = make_trainer(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"), max_epochs=max_epochs)
        trainer.fit(model, _loader(), ckpt_path=ckpt)
        return model, trainer

    full, full_trainer = run(4, 0)
    first, first_trainer = run(2, 0)
    first_trainer.save_checkpoint(tmp_path / "half.ckpt")
    saved = torch.load(tmp_path / "half.ckpt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in saved["state_dict"].values())  # fp32 weights; no remainder saved
    assert all(v.dtype == torch.float32 for s in saved["optimizer_states"][0]["state"].values() for v in s.values())
    resumed, resumed_trainer = run(4, 1, tmp_path / "half.ckpt")
    assert full_trainer.precision_plugin.scaler.skipped_steps == 2
    for name, param in full.named_parameters():
        assert torch.equal(resumed.get_parameter(name), param), name
    full_state = full_trainer.optimizers[0].state_dict()["state"]
    resumed_state = resumed_trainer.optimizers[0].state_dict()["state"]
    for key in full_state:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed_state[key][field], full_state[key][field])


def test_loading_a_state_dict_during_fit_reaches_the_remainders():
    with seeded():
        model = Net()
    store = RemainderMasters()
    store.convert(model)
    optimizer = torch.optim.AdamW(model.parameters())
    store.attach([optimizer])
    with seeded(5):
        source = Net()
    model.load_state_dict(source.state_dict())
    for (name, param), value in zip(model.named_parameters(), source.parameters()):
        assert torch.equal(store.fp32_value(param) if param.dtype == torch.bfloat16 else param, value), name
    assert model.state_dict()["net.0.weight"].dtype == torch.float32


# ---------------------------------------------------------------------- memory at rest
def test_bytes_per_parameter_at_rest_with_adamw_is_14():
    class Count(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            seen: set[int] = set()
            total = 0
            tensors = []
            for p in module.parameters():
                tensors += [p, p.grad]
            for _, low in trainer.precision_plugin.masters.flat_buffers:
                tensors.append(low)
            for state in optimizer.state.values():
                tensors += [v for k, v in state.items() if k != "step"]
            for tensor in tensors:
                if tensor is not None and tensor.untyped_storage().data_ptr() not in seen:
                    seen.add(tensor.untyped_storage().data_ptr())
                    total += tensor.untyped_storage().nbytes()
            self.total = total

    class Plain(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(32, 64), nn.Linear(64, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.body(x)).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    counter = Count()
    model = Plain()
    count = sum(p.numel() for p in model.parameters())
    loader = DataLoader(TensorDataset(torch.randn(8, 32), torch.randn(8, 1)), batch_size=4)
    make_trainer(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"), max_steps=2, callbacks=[counter]).fit(
        model, loader
    )
    # 2 (bf16 weight) + 2 (remainder) + 2 (bf16 gradient) + 8 (AdamW's fp32 moments), no fp32 copy anywhere
    assert counter.total == 14 * count


# ---------------------------------------------------------------------- diagnostics
def test_monitor_replays_a_skipped_step_with_the_exact_fp32_values_and_changes_nothing(monkeypatch):
    from lightning_mp import PrecisionMonitor
    from tests.planted import Planted, PlantedModel, fit_planted

    swapped_in: list[int] = []
    original = RemainderMasters.fp32_pairs

    def spy(self):
        for param, value in original(self):
            assert torch.equal(value, self.fp32_value(param))
            swapped_in.append(value.numel())
            yield param, value

    monkeypatch.setattr(RemainderMasters, "fp32_pairs", spy)

    def run(localise):
        monitor = PrecisionMonitor(localise_overflows=localise, sample_every=0, report=False)
        with seeded():
            model = PlantedModel(Planted("log", at=2))
        trainer, _ = fit_planted(model, monitor=monitor, precision="bf16-mixed", master_weights="remainder")
        return trainer.model.state_dict(), monitor

    with_replay, monitor = run(True)
    without, _ = run(False)
    (record,) = monitor.history.overflows
    where = (record.step, record.phase, record.module, record.op, record.cause)
    assert where == (2, "forward", "net.3", "log", "model")
    assert swapped_in, "the fp32 replay must run with the lean masters' exact values"
    for key, value in without.items():
        assert torch.equal(with_replay[key], value), key
