"""Lightning's weight-averaging tests, ported to ``MixedPrecisionPlugin(master_weights=True | "remainder")``.

Upstream (github:Lightning-AI/pytorch-lightning at 7f0c343): ``tests/tests_pytorch/callbacks/test_weight_averaging.py``
(``test_ema``, ``test_swa``, ``test_ema_resume``, ``test_ema_ddp_spawn_cpu``) and
``tests/tests_pytorch/callbacks/test_stochastic_weight_avg.py`` (``test_swa_callback``,
``test_swa_resume_training_from_checkpoint``, ``test_swa_callback_ddp_cpu``). Their call-count assertions (the
callbacks' own subclasses ``EMATestCallback``, ``SWATestCallback``, ``SwaTestCallback``) are kept as they are; added:
the average that ends in the model is the average of the exact fp32 weights (recorded through
:func:`lightning_mp.master.exact_parameters`), and a resumed EMA run ends bit for bit where an uninterrupted one does
(upstream: ``allclose``). Adapted: bf16-mixed with master weights instead of fp32; DDP on two real gloo processes
(``run_in_two_processes``) instead of ``ddp_spawn``.
"""

from __future__ import annotations

import os
from copy import deepcopy
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.strategies import Strategy
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR, get_swa_avg_fn
from torch.utils.data import DataLoader, Dataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master import exact_parameters
from tests.upstream._helpers import run_in_two_processes

MASTERS = [True, "remainder"]


def plugin(master_weights: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights)


class Record(Callback):
    """Exact fp32 weights at each epoch start and at the end of training (before the averaging callback's hooks)."""

    def __init__(self) -> None:
        self.epoch_starts: dict[int, dict[str, Tensor]] = {}

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        values = {name: value.double().clone() for name, value in exact_parameters(pl_module)}
        self.epoch_starts[trainer.current_epoch] = values


# ---------------------------------------------------------------- test_weight_averaging.py
class AveragingModel(BoringModel):
    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        layers = [nn.Linear(32, 32)]
        if batch_norm:
            layers.append(nn.BatchNorm1d(32))
        layers += [nn.ReLU(), nn.Linear(32, 2)]
        self.layer = nn.Sequential(*layers)
        self.crash_on_epoch = None

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        if self.crash_on_epoch and self.trainer.current_epoch >= self.crash_on_epoch:
            raise Exception("CRASH")
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)


class EMAAveragingFunction:
    """As upstream: ``get_ema_avg_fn()``'s closure as a class (picklable)."""

    def __init__(self, decay: float = 0.999) -> None:
        self.decay = decay

    @torch.no_grad()
    def __call__(self, ema_param: Tensor, current_param: Tensor, num_averaged: Tensor) -> Tensor:
        return self.decay * ema_param + (1 - self.decay) * current_param


class EMATestCallback(WeightAveraging):
    def __init__(self, devices: int = 1, **kwargs: Any) -> None:
        super().__init__(avg_fn=EMAAveragingFunction(), **kwargs)
        self.devices = devices
        self.swap_calls = 0
        self.copy_calls = 0
        self.first_epoch: Optional[int] = None

    def _swap_models(self, *args: Any, **kwargs: Any) -> None:
        self.swap_calls += 1
        return super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args: Any, **kwargs: Any) -> None:
        self.copy_calls += 1
        return super()._copy_average_to_current(*args, **kwargs)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        assert self.swap_calls == 0
        assert self.copy_calls == 0

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        assert self._average_model.n_averaged == trainer.global_step
        assert self.swap_calls == (trainer.current_epoch + 1 - self.first_epoch) * 2
        assert self.copy_calls == 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        steps_per_epoch = 4 // self.devices
        assert self._average_model.n_averaged == trainer.max_epochs * steps_per_epoch
        assert self.swap_calls == (trainer.max_epochs - self.first_epoch) * 2
        assert self.copy_calls == 1


class SWATestCallback(WeightAveraging):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(avg_fn=get_swa_avg_fn(), **kwargs)
        self.swap_calls = 0
        self.copy_calls = 0
        self.first_epoch: Optional[int] = None

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        return epoch_idx in (3, 5, 7)

    def _swap_models(self, *args: Any, **kwargs: Any) -> None:
        self.swap_calls += 1
        return super()._swap_models(*args, **kwargs)

    def _copy_average_to_current(self, *args: Any, **kwargs: Any) -> None:
        self.copy_calls += 1
        return super()._copy_average_to_current(*args, **kwargs)

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        expected = sum(1 for epoch in (3, 5, 7) if trainer.current_epoch >= epoch)
        assert self._average_model.n_averaged == expected
        assert self.swap_calls == (trainer.current_epoch + 1 - self.first_epoch) * 2
        assert self.copy_calls == 0

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        assert self._average_model.n_averaged == 3
        assert self.swap_calls == (trainer.max_epochs - self.first_epoch) * 2
        assert self.copy_calls == 1


class RecordEpochEnds(Callback):
    """Exact fp32 weights at each epoch end, before the averaging callback's own ``on_train_epoch_end``."""

    def __init__(self) -> None:
        self.epoch_ends: dict[int, dict[str, Tensor]] = {}

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.epoch_ends[trainer.current_epoch] = {n: v.double().clone() for n, v in exact_parameters(pl_module)}


def _train(
    model: BoringModel,
    dataset: Dataset,
    tmp_path: Any,
    callbacks: list[Callback],
    master_weights: Any,
    devices: int = 1,
    checkpoint_path: Optional[str] = None,
    will_crash: bool = False,
    **kwargs: Any,
) -> Trainer:
    kwargs.setdefault("max_epochs", 4)  # upstream: 8 (SWATestCallback needs them)
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        logger=False,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        enable_checkpointing=will_crash,
        enable_progress_bar=False,
        enable_model_summary=False,
        accumulate_grad_batches=2,
        limit_val_batches=2,  # upstream validates BoringModel's 64 batches: the swaps are what counts here
        deterministic=True,
        default_root_dir=tmp_path,
        plugins=[plugin(master_weights)],
        **kwargs,
    )
    dataloader = DataLoader(dataset, batch_size=4, shuffle=False)
    if will_crash:
        with pytest.raises(Exception, match="CRASH"):
            trainer.fit(model, dataloader, ckpt_path=checkpoint_path, weights_only=False)
    else:
        trainer.fit(model, dataloader, ckpt_path=checkpoint_path, weights_only=False)
    assert trainer.lightning_module == model
    return trainer


@pytest.mark.parametrize("master_weights", MASTERS)
@pytest.mark.parametrize("batch_norm", [True, False])
def test_ema(tmp_path, batch_norm: bool, master_weights: Any):
    """Upstream ``test_weight_averaging.py::test_ema`` (map-style dataset; the iterable one changes nothing here)."""
    torch.manual_seed(0)
    model = AveragingModel(batch_norm=batch_norm)
    callback = EMATestCallback()
    _train(model, RandomDataset(32, 32), tmp_path, [callback], master_weights)
    # added: the averaged model is fp32 (4 bytes per parameter, as with the built-in plugin)
    assert all(p.dtype == torch.float32 for p in callback._average_model.module.parameters())


@pytest.mark.parametrize("master_weights", MASTERS)
def test_swa(tmp_path, master_weights: Any):
    """Upstream ``test_weight_averaging.py::test_swa``; added: the model after fit holds the mean of the exact weights
    at the ends of epochs 3, 5 and 7 (those the callback averaged)."""
    torch.manual_seed(0)
    model = AveragingModel()
    record = RecordEpochEnds()
    _train(model, RandomDataset(32, 32), tmp_path, [record, SWATestCallback()], master_weights, max_epochs=8)
    ends = [record.epoch_ends[epoch] for epoch in (3, 5, 7)]
    for name, param in model.named_parameters():
        reference = sum(end[name] for end in ends) / 3
        assert (param.detach().double() - reference).abs().max().item() <= 1e-6, name


def _train_and_resume(model: AveragingModel, dataset: Dataset, tmp_path: Any, master_weights: Any) -> AveragingModel:
    _train(model, dataset, tmp_path, [EMATestCallback()], master_weights, will_crash=True)
    checkpoint_dir = Path(tmp_path) / "checkpoints"
    checkpoint_names = os.listdir(checkpoint_dir)
    assert len(checkpoint_names) == 1
    checkpoint_path = str(checkpoint_dir / checkpoint_names[0])
    model = AveragingModel.load_from_checkpoint(checkpoint_path, weights_only=False)
    _train(model, dataset, tmp_path, [EMATestCallback()], master_weights, checkpoint_path=checkpoint_path)
    return model


@pytest.mark.parametrize("master_weights", MASTERS)
@pytest.mark.parametrize("crash_on_epoch", [3])
def test_ema_resume(tmp_path, crash_on_epoch: int, master_weights: Any):
    """Upstream ``test_weight_averaging.py::test_ema_resume`` (4 epochs, crash at epoch 3); upstream
    asserts ``allclose``, the exact masters make it bitwise."""
    dataset = RandomDataset(32, 32)
    torch.manual_seed(0)
    model1 = AveragingModel()
    model2 = deepcopy(model1)
    _train(model1, dataset, tmp_path / "one", [EMATestCallback()], master_weights)
    model2.crash_on_epoch = crash_on_epoch
    model2 = _train_and_resume(model2, dataset, tmp_path / "two", master_weights)
    for (name, param1), param2 in zip(model1.named_parameters(), model2.parameters()):
        assert param1.dtype == param2.dtype == torch.float32 and torch.equal(param1, param2), name


def _ema_ddp(tmp_path: str) -> None:
    for master_weights in MASTERS:  # the processes start once for both
        torch.manual_seed(0)
        model = AveragingModel()
        callbacks = [EMATestCallback(devices=2)]
        _train(model, RandomDataset(32, 32), tmp_path, callbacks, master_weights, 2, strategy="ddp", max_epochs=2)


def test_ema_ddp_cpu(tmp_path):
    """Upstream ``test_weight_averaging.py::test_ema_ddp_spawn_cpu`` on two real gloo processes (``ddp``), masters
    ``True`` and ``"remainder"``: the hooks run over the exact weights without disturbing DDP (the model's parameter
    objects keep their dtype, so their gradient accumulators, which hold DDP's hooks, stay)."""
    run_in_two_processes(_ema_ddp, str(tmp_path))


# ---------------------------------------------------------------- test_stochastic_weight_avg.py
class SwaTestModel(BoringModel):
    def __init__(self, batchnorm: bool = True, interval: str = "epoch", crash_on_epoch: Optional[int] = None) -> None:
        super().__init__()
        layers = [nn.Linear(32, 32)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(32))
        layers += [nn.ReLU(), nn.Linear(32, 2)]
        self.layer = nn.Sequential(*layers)
        self.interval = interval
        self.crash_on_epoch = crash_on_epoch

    def training_step(self, batch: Tensor, batch_idx: int) -> Any:
        if self.crash_on_epoch and self.trainer.current_epoch >= self.crash_on_epoch:
            raise Exception("SWA crash test")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 64), batch_size=2)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.interval}}


class SwaTestCallback(StochasticWeightAveraging):
    update_parameters_calls: int = 0
    transfer_weights_calls: int = 0
    first_epoch: Optional[int] = None

    def update_parameters(self, *args: Any, **kwargs: Any) -> None:
        self.update_parameters_calls += 1
        return StochasticWeightAveraging.update_parameters(*args, **kwargs)

    def transfer_weights(self, *args: Any, **kwargs: Any) -> None:
        self.transfer_weights_calls += 1
        return StochasticWeightAveraging.transfer_weights(*args, **kwargs)

    def on_train_epoch_start(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if self.first_epoch is None and not trainer.fit_loop.restarting:
            self.first_epoch = trainer.current_epoch
        assert trainer.fit_loop._skip_backward == (trainer.current_epoch > self.swa_end)
        if self.swa_start <= trainer.current_epoch:
            assert isinstance(trainer.lr_scheduler_configs[0].scheduler, SWALR)
            assert trainer.lr_scheduler_configs[0].interval == "epoch"
            assert trainer.lr_scheduler_configs[0].frequency == 1

    def on_train_epoch_end(self, trainer: Trainer, *args: Any) -> None:
        super().on_train_epoch_end(trainer, *args)
        if self.swa_start <= trainer.current_epoch <= self.swa_end:
            swa_epoch = trainer.current_epoch - self.swa_start
            assert self.n_averaged == swa_epoch + 1
            assert self._swa_scheduler is not None
            assert self._swa_scheduler._step_count == swa_epoch + 2
        elif trainer.current_epoch > self.swa_end:
            assert self.n_averaged == self._max_epochs - self.swa_start

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        assert not trainer.fit_loop._skip_backward
        assert trainer.accumulate_grad_batches == 2
        assert trainer.num_training_batches == 5
        if trainer.world_size == 1:
            assert trainer.strategy.backward.call_count == (
                (trainer.max_epochs - self.first_epoch) * trainer.limit_train_batches
            )
        first_swa_epoch = max(self.first_epoch, self.swa_start)
        assert self.update_parameters_calls == trainer.max_epochs - first_swa_epoch
        assert self.transfer_weights_calls == 1


def _swa_trainer(tmp_path: Any, callbacks: list[Callback], master_weights: Any, **kwargs: Any) -> Trainer:
    defaults: dict[str, Any] = dict(
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        accelerator="cpu",
        devices=1,
        max_epochs=5,
        limit_train_batches=5,
        limit_val_batches=0,
        accumulate_grad_batches=2,
        plugins=[plugin(master_weights)],
    )
    return Trainer(callbacks=callbacks, **{**defaults, **kwargs})


class RecordTransfer(Callback):
    """With batch norm SWA transfers the average at the start of the extra epoch (its hook runs before this one)."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.transferred = {name: value.double().clone() for name, value in exact_parameters(pl_module)}


@pytest.mark.parametrize("master_weights", MASTERS)
@pytest.mark.parametrize("batchnorm", [True, False])
def test_swa_callback(tmp_path, batchnorm: bool, master_weights: Any):
    """Upstream ``test_stochastic_weight_avg.py::test_swa_callback`` (``train_with_swa``); added: the average SWA
    transfers is the mean of the exact weights at the starts of the SWA epochs (2..5, 1-based ``swa_epoch_start=2``):
    the model after fit holds it without batch norm; with batch norm, the model at the start of the extra epoch (whose
    last batch Lightning then steps: the same change with its built-in ``bf16-mixed``)."""
    torch.manual_seed(0)
    model = SwaTestModel(batchnorm=batchnorm)
    record, transfer = Record(), RecordTransfer()
    swa = SwaTestCallback(swa_epoch_start=2, swa_lrs=0.1)
    trainer = _swa_trainer(tmp_path, [record, swa, transfer], master_weights)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward):
        trainer.fit(model, weights_only=False)
    assert trainer.lightning_module == model
    starts = [record.epoch_starts[epoch] for epoch in range(swa.swa_start, swa.swa_end + 1)]
    averaged = transfer.transferred if batchnorm else {n: p.detach().double() for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        reference = sum(start[name] for start in starts) / len(starts)
        assert param.dtype == torch.float32
        assert (averaged[name] - reference).abs().max().item() <= 1e-6, name


@pytest.mark.parametrize("master_weights", MASTERS)
@pytest.mark.parametrize("crash_on_epoch", [1, 3])
def test_swa_resume_training_from_checkpoint(tmp_path, crash_on_epoch: int, master_weights: Any):
    """Upstream ``test_stochastic_weight_avg.py::test_swa_resume_training_from_checkpoint``."""
    torch.manual_seed(0)
    model = SwaTestModel(crash_on_epoch=crash_on_epoch)
    trainer = _swa_trainer(tmp_path, [SwaTestCallback(swa_epoch_start=3, swa_lrs=0.1)], master_weights)
    with (
        mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward),
        pytest.raises(Exception, match="SWA crash test"),
    ):
        trainer.fit(model, weights_only=False)
    checkpoint_files = os.listdir(Path(tmp_path) / "checkpoints")
    assert len(checkpoint_files) == 1
    ckpt_path = str(Path(tmp_path) / "checkpoints" / checkpoint_files[0])
    trainer = _swa_trainer(tmp_path, [SwaTestCallback(swa_epoch_start=3, swa_lrs=0.1)], master_weights)
    with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward):
        trainer.fit(SwaTestModel(), ckpt_path=ckpt_path, weights_only=False)
