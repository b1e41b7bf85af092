"""Weight averaging of the exact weights: Lightning's SWA and EMA callbacks, and EMA hooks through the exact API.

With master weights the model's parameters are 16-bit copies; Lightning's ``StochasticWeightAveraging`` and
``WeightAveraging``/``EMAWeightAveraging`` read and write them. The plugin runs their hooks over the exact weights
(:mod:`lightning_mp.averaging`). Reference: the same run's exact fp32 weights, recorded at each update by a
callback that reads them through :func:`lightning_mp.master.exact_parameters`, averaged in float64 in the test. Both
the checkpoint ``trainer.save_checkpoint`` writes after fit and the model left in memory must hold that average.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging, WeightAveraging
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin, averaging
from lightning_mp.kernels.bits import join_fp32
from lightning_mp.master import exact_parameters, exact_weights
from tests.helpers import fabric_trained_net

# (master_weights, optimizer_in_backward)
MODES = [(True, False), ("remainder", False), ("remainder", True)]
IDS = ["fp32-masters", "remainder", "remainder-in-backward"]


class Net(L.LightningModule):
    """A small MLP trained with AdamW at a learning rate that moves its weights far from bf16 values."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def loader(batches: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(8 * batches, 4, generator=generator), torch.randn(8 * batches, 3, generator=generator)
    )
    return DataLoader(data, batch_size=8)


class RecordExact(L.Callback):
    """Records the exact fp32 weights through the documented API after every step (and at every epoch start), and
    checks them against the masters themselves: the fp32 master tensors, or the bf16 weight joined with its
    remainder (bits.join_fp32 on the store's flat buffers, not the store's own join); a parameter kept in fp32 is its
    own exact value."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.epoch_starts: list[dict[str, torch.Tensor]] = []
        self.bf16_differs = False

    def _read(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, torch.Tensor]:
        values = {name: value.clone().double() for name, value in exact_parameters(pl_module)}
        masters = trainer.precision_plugin.masters
        for name, param in pl_module.named_parameters():
            master = masters.master_of(param)
            if not masters.model_sync.tracks(param):  # kept in fp32 by the policy (normalisation layers)
                truth = param.detach()
            elif master is not None:
                truth = master.detach()
            else:
                place = masters.offset_of(param)
                high, low = masters.flat_slices(param.device, place, place + param.numel())
                truth = join_fp32(high, low).view_as(param)
            assert torch.equal(values[name], truth.double()), name
            self.bf16_differs |= not torch.equal(values[name], param.detach().double())
        return values

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.steps.append(self._read(trainer, pl_module))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_starts.append(self._read(trainer, pl_module))


def fit(mode: tuple[Any, bool], averaging: L.Callback, tmp_path: Any, batches: int, **kwargs: Any) -> tuple:
    torch.manual_seed(0)
    model = Net()
    record = RecordExact()
    val = kwargs.pop("val_dataloaders", None)
    master_weights, in_backward = mode
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights, optimizer_in_backward=in_backward)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[plugin],
        callbacks=[record, averaging],
        **kwargs,
    )
    trainer.fit(model, loader(batches), val)
    trainer.save_checkpoint(tmp_path / "after_fit.ckpt")
    saved = torch.load(tmp_path / "after_fit.ckpt", weights_only=True)["state_dict"]
    return model, record, saved


def assert_holds(model: L.LightningModule, saved: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    exact = dict(exact_parameters(model))
    for name, value in reference.items():
        memory = (exact[name].double() - value).abs().max().item()
        checkpoint = (saved[name].double() - value).abs().max().item()
        assert memory <= 1e-6 and checkpoint <= 1e-6, (name, memory, checkpoint)
        assert model.get_parameter(name).dtype == torch.float32  # after fit the model holds fp32 values again


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_ema_weight_averaging_averages_the_exact_weights(mode, tmp_path):
    # Lightning's EMAWeightAveraging (upstream tests/tests_pytorch/callbacks/test_weight_averaging.py,
    # test_ema_weight_averaging: the average after fit equals the EMA of the weights after each step)
    decay = 0.5
    model, record, saved = fit(mode, EMAWeightAveraging(decay=decay), tmp_path, batches=6, max_epochs=1)
    assert len(record.steps) == 6 and record.bf16_differs  # the 16-bit copies differ: the test can tell them apart
    reference = dict(record.steps[0])
    for step in record.steps[1:]:
        reference = {name: decay * reference[name] + (1 - decay) * step[name] for name in reference}
    assert_holds(model, saved, reference)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_weight_averaging_swa_mean_of_every_step(mode, tmp_path):
    # Lightning's WeightAveraging without avg_fn (upstream test_weight_averaging.py, test_swa: an equal-weight
    # average of the weights after every optimizer step)
    model, record, saved = fit(mode, WeightAveraging(), tmp_path, batches=5, max_epochs=1)
    reference = {name: sum(step[name] for step in record.steps) / len(record.steps) for name in record.steps[0]}
    assert_holds(model, saved, reference)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_stochastic_weight_averaging_averages_the_exact_weights(mode, tmp_path):
    # Lightning's StochasticWeightAveraging (upstream tests/tests_pytorch/callbacks/test_stochastic_weight_avg.py,
    # test_swa_callback: the transferred average is the mean of the weights at the start of each SWA epoch)
    swa = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=2, annealing_epochs=1)
    model, record, saved = fit(mode, swa, tmp_path, batches=2, max_epochs=4)
    averaged = record.epoch_starts[1:4]  # epochs swa_start=1 .. swa_end=3: the weights after epochs 0, 1, 2
    assert swa.n_averaged.item() == len(averaged)
    reference = {name: sum(start[name] for start in averaged) / len(averaged) for name in averaged[0]}
    assert_holds(model, saved, reference)


@pytest.mark.parametrize("mode", MODES[:2], ids=IDS[:2])
def test_ema_swap_around_validation_leaves_training_unchanged(mode, tmp_path):
    # WeightAveraging swaps the average into the model for validation and back after it (upstream
    # test_weight_averaging.py runs validation too): the swap back must give the masters their exact values, so a
    # run with validation trains exactly as one without
    runs = []
    for validate in (False, True):
        extra = {"val_dataloaders": loader(2), "val_check_interval": 2} if validate else {"limit_val_batches": 0}
        model, record, saved = fit(mode, EMAWeightAveraging(decay=0.5), tmp_path, batches=6, max_epochs=1, **extra)
        runs.append((record.steps, saved))
    for without, with_validation in zip(runs[0][0], runs[1][0]):
        assert all(torch.equal(without[name], with_validation[name]) for name in without)
    assert all(torch.equal(runs[0][1][name], runs[1][1][name]) for name in runs[0][1])


@pytest.mark.parametrize("mode", MODES[:2], ids=IDS[:2])
def test_the_plugin_says_it_adapted_and_puts_the_hooks_back(mode, tmp_path, caplog):
    ema = EMAWeightAveraging(decay=0.5)
    with caplog.at_level("INFO"):
        fit(mode, ema, tmp_path, batches=2, max_epochs=1)
    assert "EMAWeightAveraging averages the exact fp32 master weights" in caplog.text
    assert "on_train_batch_end" not in vars(ema)  # Lightning's own hook again after teardown
    assert "update_parameters" not in vars(ema._average_model)


def test_sparse_ema_updates_read_the_exact_weights_only_when_they_run(tmp_path, monkeypatch):
    # EMAWeightAveraging(update_every_n_steps=2): the averaged model reads the model on steps 0, 2, 4 only; the exact
    # weights are made for those reads (with "remainder" each joins the whole model) and for the write-back at the end
    entries = []
    real = averaging.exact_weights

    def counting(module, store=None, write=True):
        entries.append(write)
        return real(module, store=store, write=write)

    monkeypatch.setattr(averaging, "exact_weights", counting)
    ema = EMAWeightAveraging(decay=0.5, update_every_n_steps=2)
    model, record, saved = fit(("remainder", False), ema, tmp_path, batches=6, max_epochs=1)
    assert entries == [False, False, False, True]  # three updates, then on_train_end's write-back
    reference = dict(record.steps[0])
    for step in (record.steps[2], record.steps[4]):
        reference = {name: 0.5 * reference[name] + 0.5 * step[name] for name in reference}
    assert_holds(model, saved, reference)


class EmaTeacher(L.Callback):
    """An EMA teacher as BYOL/DINO/diffusion code keeps one: an fp32 copy updated in on_train_batch_end from the
    student's exact weights, one parameter at a time."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.teacher: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        for name, weight in exact_parameters(pl_module):
            if name not in self.teacher:
                self.teacher[name] = weight.clone()
            else:
                self.teacher[name].lerp_(weight, 1 - self.decay)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_ema_hook_reads_the_exact_weights(mode, tmp_path):
    teacher = EmaTeacher(decay=0.7)
    _, record, _ = fit(mode, teacher, tmp_path, batches=5, max_epochs=1)  # RecordExact checks each read vs masters
    reference = dict(record.steps[0])
    for step in record.steps[1:]:
        reference = {name: 0.7 * reference[name] + 0.3 * step[name] for name in reference}
    for name, value in reference.items():
        assert (teacher.teacher[name].double() - value).abs().max().item() <= 1e-6


@pytest.mark.parametrize("master_weights", [True, "remainder"])
def test_exact_weights_writes_reach_the_masters_by_any_means(master_weights):
    # the write API: inside exact_weights the parameters are fp32 and any write (.data.copy_ included) lands in the
    # masters exactly; outside, the model holds their bf16 rounding
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights)
    plugin.convert_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    plugin.connect(model, [optimizer], [])
    originals = list(model.parameters())
    targets = [torch.randn(p.shape) for p in originals]
    with plugin.exact_weights(model) as inner:
        assert all(p.dtype == torch.float32 for p in inner.parameters())
        first, *rest = list(inner.parameters())
        first.data.copy_(targets[0])  # Lightning's write-back: invisible to the masters outside this context
        with torch.no_grad():
            for param, target in zip(rest, targets[1:]):
                param.copy_(target)
    assert [id(p) for p in model.parameters()] == [id(p) for p in originals]  # the model's own objects are back
    for (name, value), param, target in zip(plugin.exact_parameters(model), model.parameters(), targets):
        assert torch.equal(value, target), name
        assert param.dtype == torch.bfloat16 and torch.equal(param.detach().float(), target.bfloat16().float())
    plugin.follow_model_writes()  # the plugin's own write-back is not taken for a later write
    assert all(torch.equal(v, t) for (_, v), t in zip(plugin.exact_parameters(model), targets))
    plugin.teardown()
    assert all(torch.equal(p.detach(), t) for p, t in zip(model.parameters(), targets))


def test_exact_api_without_master_weights_gives_the_parameters():
    model = nn.Linear(3, 2)
    assert all(value is not param and torch.equal(value, param) for (_, value), param in
               zip(exact_parameters(model), model.parameters()))  # fmt: skip
    with exact_weights(model) as inner:
        assert inner is model and next(inner.parameters()) is model.weight


@pytest.mark.parametrize("master_weights", [True, "remainder"])
def test_exact_api_under_fabric(master_weights):
    # a Fabric-wrapped module finds its plugin through the strategy: the reads are the masters (the fp32 values
    # fabric.save writes), the writes land in them
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights)
    _, net = fabric_trained_net(plugin)
    saved = net.state_dict()  # the exact fp32 masters (the state-dict hook)
    read = dict(exact_parameters(net))
    assert read.keys() == saved.keys()
    assert all(torch.equal(read[name], saved[name]) for name in saved)
    assert any(not torch.equal(read[name], p.detach().float()) for name, p in net.module.named_parameters())
    with exact_weights(net) as inner:
        for param in inner.parameters():
            param.data.copy_(torch.full_like(param, 0.123456789))
    assert all(torch.equal(value, torch.full_like(value, 0.123456789)) for value in net.state_dict().values())


class DiffusersEma(L.Callback):
    """diffusers' own ``EMAModel`` as a diffusion training script drives it: ``step(model.parameters())`` after each
    optimizer step, ``copy_to(model.parameters())`` at the end; here through ``exact_weights``."""

    def __init__(self, model: nn.Module) -> None:
        from diffusers.training_utils import EMAModel

        self.ema = EMAModel(model.parameters(), decay=0.9, foreach=True)
        self.decays: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with exact_weights(pl_module, write=False) as module:
            self.ema.step(module.parameters())  # keeps the parameters that require grad: the fp32 stand-ins do
        self.decays.append(self.ema.cur_decay_value)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with exact_weights(pl_module) as module:
            self.ema.copy_to(module.parameters())  # param.data copies: they land in the masters


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_diffusers_ema_model_through_exact_weights(mode, tmp_path):
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    initial = {name: p.detach().double().clone() for name, p in Net().named_parameters()}
    torch.manual_seed(0)
    callback = DiffusersEma(Net())  # built, as diffusers' scripts do, from the fp32 model before training
    model, record, saved = fit(mode, callback, tmp_path, batches=5, max_epochs=1)
    reference = initial
    for decay, step in zip(callback.decays, record.steps):
        reference = {name: decay * reference[name] + (1 - decay) * step[name] for name in reference}
    assert callback.decays[0] == 0.0 and callback.decays[-1] > 0.3  # diffusers' warm-up: the average moves
    assert_holds(model, saved, reference)


def test_exact_api_refuses_lean_masters_sharded_by_fsdp2():
    # the store FSDP2 gives lean masters (as tests/test_lean_masters_fsdp2.py builds it): the remainders of local
    # shards only, so no whole exact parameter exists on a rank
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_mp.distributed import sync_for
    from lightning_mp.master.model_sync import ModelSync

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    strategy = ModelParallelStrategy(save_distributed_checkpoint=False)
    strategy.parallel_devices = [torch.device("cpu")]
    sharded = sync_for(strategy, plugin).adopt(plugin.masters)
    module = nn.Linear(2, 2)
    sharded.model_sync = ModelSync(sharded, module, {})
    with pytest.raises(ValueError, match="lean masters are sharded by FSDP2.*master_weights=True under FSDP2"):
        list(exact_parameters(module, store=sharded))
    with pytest.raises(ValueError, match="lean masters are sharded by FSDP2"), exact_weights(module, store=sharded):
        pass
    ema = EMAWeightAveraging()
    net = Net()
    net._trainer = L.Trainer(accelerator="cpu", callbacks=[ema], logger=False, enable_checkpointing=False)
    assert averaging.adapt_averaging_callbacks(net, sharded) == []  # not adapted under FSDP2
    assert averaging.adapt_averaging_callbacks(net, plugin.masters) == [ema]  # (an unsharded store is)
    averaging.restore_averaging_callbacks([ema])
    assert not {"on_train_end", "on_train_batch_end"} & set(vars(ema))
