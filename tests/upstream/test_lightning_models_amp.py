"""Ports of Lightning's model-level AMP tests and its 16-mixed gradient-clipping tests to our plugin, on CPU.

Sources (github:Lightning-AI/pytorch-lightning): tests/tests_pytorch/models/test_amp.py and
tests/tests_pytorch/trainer/test_trainer.py (test_gradient_clipping_by_norm / _by_value, whose 16-mixed case
needs CUDA upstream). See tests/upstream/README.md for the full list.
"""

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.demos.boring_classes import BoringModel
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.upstream._helpers import MASTER_WEIGHTS, grads_of, run_in_two_processes, trainer_with


class AMPTestModel(BoringModel):
    def step(self, batch):
        self._assert_autocast_enabled()
        output = self(batch)
        self._assert_output_dtype(output)
        return self.loss(output)

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        self._assert_autocast_enabled()
        output = self(batch)
        self._assert_output_dtype(output)
        return output

    def _assert_output_dtype(self, output):
        # upstream writes `assert output.dtype == torch.float16 if not is_bfloat16 else torch.bfloat16`, which
        # asserts nothing for bf16 (it parses as `assert (...) if ... else torch.bfloat16`); we check both
        is_bfloat16 = self.trainer.precision_plugin.precision == "bf16-mixed"
        assert output.dtype == (torch.bfloat16 if is_bfloat16 else torch.float16)

    def _assert_autocast_enabled(self):
        device_type = self.trainer.precision_plugin.device_type
        assert device_type == "cpu"
        assert torch.is_autocast_enabled(device_type)


def _fit_test_predict(tmp_path, precision, master_weights=False, **trainer_kwargs):
    trainer = trainer_with(
        MixedPrecisionPlugin(precision, master_weights=master_weights),
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=1,
        **trainer_kwargs,
    )
    model = AMPTestModel()
    trainer.fit(model)
    trainer.test(model)
    trainer.predict(model)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_amp_cpus(tmp_path, precision, master_weights):
    """Port of tests/tests_pytorch/models/test_amp.py::test_amp_cpus (the single_device cases; the ddp_spawn
    cases are test_amp_cpus_ddp below). Also stands for test_amp_gpus: the same check on CUDA upstream."""
    _fit_test_predict(tmp_path, precision, master_weights, devices=1, strategy="single_device")


def _amp_cpus_in_two_processes(tmp_path):
    for precision in ("16-mixed", "bf16-mixed"):
        for masters in (False, True, "remainder") if precision == "bf16-mixed" else (False, True):
            folder = tmp_path / f"{precision}-{masters}"
            _fit_test_predict(folder, precision, masters, devices=2, strategy="ddp")


def test_amp_cpus_ddp(tmp_path):
    """Port of tests/tests_pytorch/models/test_amp.py::test_amp_cpus, its ("ddp_spawn", ..., 2) cases.

    Adapted: two real CPU processes (gloo) started once for both precisions, with Lightning's ``ddp``
    strategy joining them, instead of ``ddp_spawn`` starting two processes for each fit, test and predict
    (six times as many process starts; the point, AMP under DDP on CPU, is the same). Each precision also runs
    with fp32 master weights, and bf16 with the lean ``"remainder"`` masters (docs/many-devices.md, "DDP").
    """
    run_in_two_processes(_amp_cpus_in_two_processes, tmp_path)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
@pytest.mark.parametrize("clip_val", [0, 10])
@mock.patch("torch.nn.utils.clip_grad_norm_")
def test_precision_16_clip_gradients(mock_clip_grad_norm, clip_val, master_weights, tmp_path):
    """Port of tests/tests_pytorch/models/test_amp.py::test_precision_16_clip_gradients.

    Clip gradients is only called if the value is greater than 0.
    """
    model = BoringModel()
    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", master_weights=master_weights),
        default_root_dir=tmp_path,
        max_epochs=1,
        devices=1,
        limit_train_batches=4,
        limit_val_batches=0,
        gradient_clip_val=clip_val,
    )
    trainer.fit(model)

    if clip_val > 0:
        mock_clip_grad_norm.assert_called()
    else:
        mock_clip_grad_norm.assert_not_called()


class ClassificationModel(LightningModule):
    """The model of Lightning's tests/tests_pytorch/helpers/simple_models.py::ClassificationModel, without its
    torchmetrics accuracy (not needed for clipping)."""

    def __init__(self, num_features=32, num_classes=3, lr=0.01):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            *[layer for _ in range(3) for layer in (nn.Linear(num_features, num_features), nn.ReLU())],
            nn.Linear(num_features, num_classes),
        )

    def forward(self, x):
        return F.softmax(self.net(x), dim=1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def _classification_data(num_features=32, length=800, num_classes=3, batch_size=10):
    """Lightning's ClassifDataModule data: sklearn's make_classification with the same arguments."""
    from sklearn.datasets import make_classification

    x, y = make_classification(
        n_samples=length,
        n_features=num_features,
        n_classes=num_classes,
        n_clusters_per_class=1,
        n_informative=2,
        random_state=42,
    )
    dataset = TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long))
    return DataLoader(dataset, batch_size=batch_size)


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
def test_gradient_clipping_by_norm(tmp_path, master_weights):
    """Port of tests/tests_pytorch/trainer/test_trainer.py::test_gradient_clipping_by_norm (its 16-mixed case).

    The norm of the gradients the optimizer uses is the clip value. Adapted: our plugin on CPU; with master
    weights the gradients are read on the fp32 masters. The 32-true case runs no mixed precision: not ported.
    """
    pytest.importorskip("sklearn")
    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", master_weights=master_weights),
        default_root_dir=tmp_path,
        max_steps=1,
        max_epochs=1,
        devices=1,
        gradient_clip_algorithm="norm",
        gradient_clip_val=0.05,
    )

    class TestModel(ClassificationModel):
        def configure_gradient_clipping(self, *args, **kwargs):
            super().configure_gradient_clipping(*args, **kwargs)
            # test that gradient is clipped correctly
            grads = grads_of(self.trainer, self.parameters())
            grad_norm = torch.norm(torch.stack([torch.norm(g.detach(), 2) for g in grads]), 2)
            torch.testing.assert_close(grad_norm, torch.tensor(0.05, device=self.device))
            self.assertion_called = True

    model = TestModel()
    trainer.fit(model, _classification_data())
    assert model.assertion_called


@pytest.mark.parametrize("master_weights", MASTER_WEIGHTS)
def test_gradient_clipping_by_value(tmp_path, master_weights):
    """Port of tests/tests_pytorch/trainer/test_trainer.py::test_gradient_clipping_by_value (its 16-mixed case).

    Adapted as test_gradient_clipping_by_norm.
    """
    trainer = trainer_with(
        MixedPrecisionPlugin("16-mixed", master_weights=master_weights),
        default_root_dir=tmp_path,
        max_steps=1,
        max_epochs=1,
        devices=1,
        gradient_clip_algorithm="value",
        gradient_clip_val=1e-10,
    )

    class TestModel(BoringModel):
        def configure_gradient_clipping(self, *args, **kwargs):
            super().configure_gradient_clipping(*args, **kwargs)
            # test that gradient is clipped correctly
            grads = grads_of(self.trainer, self.parameters())
            grad_max_list = [torch.max(g.detach().abs()) for g in grads]
            grad_max = torch.max(torch.stack(grad_max_list))
            torch.testing.assert_close(grad_max.abs(), torch.tensor(1e-10, device=self.device))
            self.assertion_called = True

    model = TestModel()
    trainer.fit(model)
    assert model.assertion_called
