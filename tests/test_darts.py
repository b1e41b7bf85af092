"""darts with the plugin, through its own route: ``pl_trainer_kwargs={"callbacks": [MixedPrecisionCallback(...)]}``.

darts builds its ``pytorch_lightning.Trainer`` from ``pl_trainer_kwargs`` and always adds a precision of its own
(``"32-true"`` for float32 series), so ``plugins=[MixedPrecisionPlugin(...)]`` is refused by Lightning ("Received both
precision=32-true and plugins=..."). A small NBEATS on a tiny synthetic monthly-like series (season 12, trend, noise)
is trained three times from the same seed: fp32, Lightning's built-in ``bf16-mixed`` and the callback with
``"bf16-mixed"`` and ``master_weights="remainder"``; then predicted, saved, reloaded and predicted again.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

darts = pytest.importorskip(
    "darts", reason="darts is not installed (README's set-up: pip install --no-deps darts==0.48.1, plus the dev extra)"
)

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from darts import TimeSeries  # noqa: E402
from darts.models import NBEATSModel  # noqa: E402

from lightning_mp.pytorch_lightning import MixedPrecisionCallback, MixedPrecisionPlugin  # noqa: E402
from tests.helpers import getting_started_block  # noqa: E402

EPOCHS = 10
STEPS_PER_EPOCH = 9  # 300 values, windows of 24 + 6: 271 samples, 8 batches of 32 and one of 15
QUIET = {"accelerator": "cpu", "logger": False, "enable_progress_bar": False, "enable_model_summary": False}


def series(dtype: Any = np.float32) -> TimeSeries:
    t = np.arange(300)
    y = 10 + 3 * np.sin(2 * np.pi * t / 12) + 0.02 * t + np.random.default_rng(0).normal(0, 0.3, t.size)
    return TimeSeries.from_values(y.astype(dtype))


class Record(pl.Callback):
    """The losses darts' training step returned, the dtype the weights had in each step, and the precision plugin
    and weight dtype of each prediction batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.weight_dtypes: set[torch.dtype] = set()
        self.predicted_by: list[tuple[str, torch.dtype]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, index: int) -> None:
        self.losses.append(float(outputs["loss"]))
        self.weight_dtypes.add(next(module.parameters()).dtype)

    def on_predict_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        self.predicted_by.append((type(trainer.precision_plugin).__name__, next(module.parameters()).dtype))


def nbeats(callbacks: list[pl.Callback], **trainer: Any) -> NBEATSModel:
    return NBEATSModel(
        input_chunk_length=24,
        output_chunk_length=6,
        num_stacks=2,
        num_blocks=1,
        num_layers=2,
        layer_widths=32,
        n_epochs=EPOCHS,
        batch_size=32,
        optimizer_kwargs={"lr": 3e-3},
        random_state=0,
        pl_trainer_kwargs={"callbacks": callbacks, **QUIET, **trainer},
    )


def train(*callbacks: pl.Callback, **trainer: Any) -> tuple[Record, np.ndarray, NBEATSModel]:
    record = Record()
    model = nbeats([record, *callbacks], **trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(series())
        forecast = model.predict(6).values()
    return record, forecast, model


def test_nbeats_trains_and_predicts_with_the_callback_as_with_fp32_and_the_builtin_bf16():
    fp32, fp32_forecast, _ = train()
    builtin, builtin_forecast, _ = train(precision="bf16-mixed")
    mixed = MixedPrecisionCallback("bf16-mixed", master_weights="remainder")
    ours, forecast, model = train(mixed)
    assert len(ours.losses) == len(fp32.losses) == EPOCHS * STEPS_PER_EPOCH
    # fit: the lean masters' bf16 model in every step (the built-in keeps fp32 weights under autocast)
    assert ours.weight_dtypes == {torch.bfloat16} and builtin.weight_dtypes == {torch.float32}
    # predict: darts' second Trainer (precision="32-true" again) got a plugin of its own from the same callback
    assert set(ours.predicted_by) == {("MixedPrecisionPlugin", torch.bfloat16)}
    assert set(builtin.predicted_by) == {("MixedPrecision", torch.float32)}
    assert type(mixed.plugin) is MixedPrecisionPlugin and model.trainer.precision_plugin is mixed.plugin
    assert model.trainer.precision == "bf16-mixed" and model.trainer_params["precision"] == "32-true"
    assert next(model.model.parameters()).dtype == torch.float32  # after predict: the exact fp32 weights again
    # exact masters and bf16 autocast are the built-in bf16-mixed's numerics: the same losses up to the rare bf16 tie
    # of the lean masters; both within bf16's distance of fp32 (measured: first epoch 140.9, last 2.215 fp32, 2.203
    # built-in, 2.205 ours; the bf16 forecasts, rounded to bf16 by darts' output, within 0.13 of each other and of fp32)
    final = {name: float(np.mean(r.losses[-STEPS_PER_EPOCH:])) for name, r in (("fp32", fp32), ("bf16", builtin))}
    final["ours"] = float(np.mean(ours.losses[-STEPS_PER_EPOCH:]))
    assert final["ours"] < np.mean(ours.losses[:STEPS_PER_EPOCH]) / 20, final  # it trains
    assert final["ours"] == pytest.approx(final["bf16"], rel=0.02), final
    assert final["ours"] == pytest.approx(final["fp32"], rel=0.1), final
    assert np.abs(forecast - builtin_forecast).max() < 0.25, (forecast.ravel(), builtin_forecast.ravel())
    assert np.abs(forecast - fp32_forecast).max() < 0.25, (forecast.ravel(), fp32_forecast.ravel())


def test_a_saved_and_reloaded_nbeats_predicts_with_the_plugin(tmp_path, monkeypatch):
    """docs/getting-started.md's darts block, run as written: the callback is saved with the model, the reloaded
    model's Trainer gets a plugin from it, and its forecast is bitwise the trained model's (exact fp32 weights)."""

    source = getting_started_block("NBEATSModel.load")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(source, "docs/getting-started.md", "exec"), namespace)
    model, loaded = namespace["model"], namespace["loaded"]
    reloaded_callback = [c for c in loaded.trainer_params["callbacks"] if isinstance(c, MixedPrecisionCallback)]
    assert len(reloaded_callback) == 1 and reloaded_callback[0] is not namespace["mixed"]
    assert repr(reloaded_callback[0]) == "MixedPrecisionCallback('bf16-mixed', master_weights='remainder')"
    assert type(loaded.trainer.precision_plugin) is MixedPrecisionPlugin  # the reloaded model's predict
    assert loaded.trainer.precision_plugin is reloaded_callback[0].plugin
    assert model.trainer.precision_plugin is namespace["mixed"].plugin
    assert np.array_equal(namespace["again"].values(), namespace["forecast"].values())
    trained = dict(model.model.state_dict())
    for name, value in loaded.model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, trained[name]), name


def test_the_plugin_in_pl_trainer_kwargs_is_refused_by_lightning_next_to_darts_precision():
    """What a darts user meets first (docs/troubleshooting.md): darts adds precision="32-true" to the Trainer."""
    model = nbeats([], plugins=[MixedPrecisionPlugin("bf16-mixed")])
    with pytest.raises(ValueError, match=r"Received both `precision=32-true` and `plugins="):
        model.fit(series(), epochs=1)


def test_a_float64_series_is_refused_with_what_to_change():
    """darts asks for "64-true" (and casts the model to float64) for a float64 series: the callback refuses it."""
    model = nbeats([MixedPrecisionCallback("bf16-mixed")])
    with pytest.raises(ValueError, match=r"DoublePrecision \(precision='64-true'\).*series\.astype\(np\.float32\)"):
        model.fit(series(np.float64), epochs=1)


def test_a_trainer_passed_to_fit_leaves_later_trainers_with_the_builtin():
    """The route that seems to work (docs/getting-started.md says why not to take it): ``fit(trainer=...)`` trains
    with the plugin, and darts copies that Trainer's precision string into the Trainers it builds later."""
    record = Record()
    model = nbeats([record])
    trainer = pl.Trainer(
        plugins=[MixedPrecisionPlugin("bf16-mixed")],
        max_epochs=1,
        callbacks=[record],
        enable_checkpointing=False,
        **QUIET,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(series(), trainer=trainer)
        model.predict(6)
    assert trainer.precision_plugin.scaler.steps == STEPS_PER_EPOCH
    assert model.trainer_params["precision"] == "bf16-mixed"
    assert set(record.predicted_by) == {("MixedPrecision", torch.float32)}  # Lightning's built-in, not the plugin


def test_darts_safe_loading_names_the_callback_until_it_is_allowed(tmp_path):
    """``NBEATSModel.load`` refuses the saved callback's class until darts' ``add_safe_globals`` / ``safe_globals``
    names it (docs/troubleshooting.md); then the reloaded model's Trainer gets the plugin."""
    from darts.utils.serialization import clear_safe_globals, get_safe_globals, safe_globals
    from darts.utils.serialization.base import UnpicklingError

    model = nbeats([MixedPrecisionCallback("bf16-mixed")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(series(), epochs=1)
    model.save(str(tmp_path / "nbeats.pt"))
    registered = get_safe_globals()
    clear_safe_globals()  # what another test (the docs block) registered in this process
    try:
        with pytest.raises(UnpicklingError, match=r"lightning_mp\.pytorch_lightning\.MixedPrecisionCallback"):
            NBEATSModel.load(str(tmp_path / "nbeats.pt"))
        with safe_globals([MixedPrecisionCallback]):
            loaded = NBEATSModel.load(str(tmp_path / "nbeats.pt"))
    finally:
        clear_safe_globals()
        darts.utils.serialization.add_safe_globals(registered)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded.predict(6)
    assert type(loaded.trainer.precision_plugin) is MixedPrecisionPlugin
