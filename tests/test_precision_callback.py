"""``MixedPrecisionCallback``: the plugin installed through the callbacks of a Trainer that a project builds with a
precision flag of its own (darts, pytorch_tabular), where Lightning refuses ``plugins=[...]`` next to ``precision=``.

Without darts or pytorch_tabular: a Trainer built the way they build theirs (``precision="32-true"`` or ``"32"``, the
callback in ``callbacks``) trains bit for bit as ``Trainer(plugins=[MixedPrecisionPlugin(...)])``, under both
Lightning packages; what the callback takes the place of and what it refuses; a Trainer keeps its plugin for its
later runs, each new Trainer gets a new one; the callback pickles as its arguments. tests/test_darts.py and
tests/test_pytorch_tabular.py run it inside the projects.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import lightning as L
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_mp
from lightning_mp import pytorch_lightning as mp_pl
from lightning_mp.callbacks.precision_callback import MixedPrecisionCallback

QUIET = {
    "accelerator": "cpu",
    "max_steps": 6,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}
REMAINDER = {"precision": "bf16-mixed", "master_weights": "remainder"}


def loader() -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=gen)
    return DataLoader(TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])), batch_size=8)


def regressor(base: type) -> Any:
    class Regressor(base):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
            self.weight_dtypes: set[torch.dtype] = set()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.weight_dtypes.add(self.net[0].weight.dtype)
            x, y = batch
            return nn.functional.mse_loss(self.net(x).float(), y)

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Regressor()


PACKAGES = {
    "lightning": (L.Trainer, L.LightningModule, lightning_mp.MixedPrecisionPlugin, MixedPrecisionCallback),
    "pytorch_lightning": (pl.Trainer, pl.LightningModule, mp_pl.MixedPrecisionPlugin, mp_pl.MixedPrecisionCallback),
}


@pytest.mark.parametrize("precision", ["32-true", "32", "bf16-mixed"])
@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_the_callback_trains_bit_for_bit_as_the_plugin_passed_in_plugins(package, precision):
    """The projects' default precision (``"32-true"``: darts; ``"32"``: pytorch_tabular), or a flag that repeats the
    plugin's own (``"bf16-mixed"``), with the callback: the plugin's run exactly, every step driven by it."""
    trainer_class, base, plugin_class, callback_class = PACKAGES[package]
    plain = regressor(base)
    trainer_class(plugins=[plugin_class(**REMAINDER)], **QUIET).fit(plain, loader())
    callback = callback_class(**REMAINDER)
    model = regressor(base)
    trainer = trainer_class(precision=precision, callbacks=[callback], **QUIET)
    trainer.fit(model, loader())
    assert type(callback.plugin) is plugin_class and trainer.precision_plugin is callback.plugin
    assert callback.plugin.scaler.steps == QUIET["max_steps"]  # the plugin drove every step
    assert model.weight_dtypes == {torch.bfloat16}  # the lean masters' bf16 model, not fp32 weights under autocast
    assert model.net[0].weight.dtype == torch.float32  # teardown gave the exact fp32 weights back
    for ours, reference in zip(model.parameters(), plain.parameters()):
        assert torch.equal(ours, reference)


def test_a_trainer_keeps_its_plugin_and_each_new_trainer_gets_a_new_one():
    """As with a built-in precision: a ``fit`` then a ``predict`` on one Trainer share its plugin (pytorch_tabular's
    ``evaluate`` runs on the fit's Trainer), and a new Trainer with the same callback (darts builds one per
    ``predict``) gets a new plugin; the callback's ``plugin`` is the latest Trainer's."""
    callback = mp_pl.MixedPrecisionCallback(**REMAINDER)
    model = regressor(pl.LightningModule)
    first = pl.Trainer(precision="32-true", callbacks=[callback], **QUIET)
    first.fit(model, loader())
    trained = callback.plugin
    first.predict(model, loader())
    assert callback.plugin is trained and first.precision_plugin is trained and trained.scaler.steps == 6
    second = pl.Trainer(precision="32-true", callbacks=[callback], **QUIET)
    forecast = torch.cat(second.predict(model, loader()))
    assert second.precision_plugin is callback.plugin and callback.plugin is not trained
    assert forecast.dtype == torch.bfloat16  # the plugin's bf16 model ran the prediction
    first.predict(model, loader())  # the first Trainer again: still its own plugin, not refused as a second one
    assert first.precision_plugin is trained


@pytest.mark.parametrize(
    ("precision", "shown"),
    [("64-true", "DoublePrecision (precision='64-true')"), ("bf16-true", "HalfPrecision (precision='bf16-true')")],
)
def test_another_precision_is_refused_with_what_to_change(precision, shown):
    trainer = pl.Trainer(precision=precision, callbacks=[mp_pl.MixedPrecisionCallback(**REMAINDER)], **QUIET)
    with pytest.raises(ValueError, match="takes the place of the Trainer's default precision") as raised:
        trainer.fit(regressor(pl.LightningModule), loader())
    assert shown in str(raised.value) and "series.astype(np.float32)" in str(raised.value)


def test_fp16_callback_refuses_a_trainer_with_builtin_bf16():
    trainer = pl.Trainer(precision="bf16-mixed", callbacks=[mp_pl.MixedPrecisionCallback("16-mixed")], **QUIET)
    with pytest.raises(ValueError, match=r"MixedPrecision \(precision='bf16-mixed'\)"):
        trainer.fit(regressor(pl.LightningModule), loader())


def test_a_plugin_given_twice_is_refused():
    trainer = pl.Trainer(
        plugins=[mp_pl.MixedPrecisionPlugin("bf16-mixed")],
        callbacks=[mp_pl.MixedPrecisionCallback("bf16-mixed")],
        **QUIET,
    )
    with pytest.raises(ValueError, match="already has MixedPrecisionPlugin"):
        trainer.fit(regressor(pl.LightningModule), loader())


def test_a_monitor_listed_before_the_callback_is_refused_and_after_it_reports_the_plugin(tmp_path):
    early = pl.Trainer(
        callbacks=[mp_pl.PrecisionMonitor(report=False), mp_pl.MixedPrecisionCallback("bf16-mixed")], **QUIET
    )
    with pytest.raises(ValueError, match="PrecisionMonitor is listed before MixedPrecisionCallback"):
        early.fit(regressor(pl.LightningModule), loader())
    monitor = mp_pl.PrecisionMonitor(report=False)
    trainer = pl.Trainer(callbacks=[mp_pl.MixedPrecisionCallback("bf16-mixed"), monitor], **QUIET)
    trainer.fit(regressor(pl.LightningModule), loader())
    assert monitor.history.precision == "bf16"  # read from the installed plugin (the default one reads "fp32")


def test_bad_plugin_arguments_raise_when_the_callback_is_built():
    with pytest.raises(ValueError, match="is not supported: use one of"):
        mp_pl.MixedPrecisionCallback("bf16")
    with pytest.raises(ValueError, match="keep_norm_fp32"):
        MixedPrecisionCallback("bf16-mixed", keep_norm_fp32="yes")


def test_the_callback_pickles_as_its_arguments():
    """darts pickles the callbacks with the model (``model.save``), pytorch_tabular with joblib (``save_model``), darts
    deep-copies them (``__setstate__``, ``untrained_model``): the arguments travel, the plugin of a Trainer does not."""
    callback = mp_pl.MixedPrecisionCallback("bf16-mixed", master_weights="remainder", scaler={"enabled": False})
    pl.Trainer(precision="32-true", callbacks=[callback], **QUIET).fit(regressor(pl.LightningModule), loader())
    assert callback.plugin is not None
    for copied in (pickle.loads(pickle.dumps(callback)), copy.deepcopy(callback)):
        assert type(copied) is mp_pl.MixedPrecisionCallback and copied.plugin is None
        assert repr(copied) == repr(callback)
        assert (
            repr(copied)
            == "MixedPrecisionCallback('bf16-mixed', master_weights='remainder', scaler={'enabled': False})"
        )
        model = regressor(pl.LightningModule)
        pl.Trainer(precision="32-true", callbacks=[copied], **QUIET).fit(model, loader())
        assert not copied.plugin.scaler.enabled and model.weight_dtypes == {torch.bfloat16}
