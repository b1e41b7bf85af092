"""``LastCheckpoint``: ``last.ckpt`` is the latest state, where Lightning's ``save_last`` copies the best one."""

from __future__ import annotations

import random
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp.cli.checkpoints import LastCheckpoint, rng_states, set_rng_states


class GetsWorse(L.LightningModule):
    """Its validation score is best after the first epoch and worse after every later one."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("score", -float(self.current_epoch))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _loader() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4)  # 4 steps per epoch


def _fit(tmp_path, callbacks, **kwargs) -> None:
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(GetsWorse(), _loader(), _loader())


def test_last_ckpt_is_the_final_state_where_lightnings_save_last_is_a_copy_of_the_best(tmp_path):
    ours, lightnings = tmp_path / "ours", tmp_path / "lightning"
    _fit(
        tmp_path,
        [
            LastCheckpoint(dirpath=str(ours)),
            ModelCheckpoint(dirpath=str(lightnings), monitor="score", mode="max", save_last=True),
        ],
        max_epochs=3,
    )
    assert torch.load(ours / "last.ckpt", weights_only=True)["global_step"] == 12
    assert torch.load(lightnings / "last.ckpt", weights_only=True)["global_step"] == 4  # why LastCheckpoint exists


def test_last_ckpt_is_written_when_fit_stops_mid_epoch_and_every_n_steps(tmp_path):
    steps_saved = []

    class Spy(L.Callback):
        def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
            steps_saved.append(checkpoint["global_step"])

    _fit(
        tmp_path,
        [LastCheckpoint(dirpath=str(tmp_path), every_n_train_steps=3), Spy()],
        max_steps=7,
        limit_val_batches=0,
    )
    assert steps_saved == [3, 4, 6, 7]  # every 3 steps, the end of epoch 0 (step 4), the end of fit (step 7)
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 7


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    L.seed_everything(3)
    saved = rng_states()
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.save({"rng": saved}, tmp_path / "rng.ckpt")
    L.seed_everything(4)
    set_rng_states(torch.load(tmp_path / "rng.ckpt", weights_only=True)["rng"])
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(again[0], expected[0]) and (again[1] == expected[1]).all() and again[2] == expected[2]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_every_n_train_steps_is_refused_naming_the_value(bad):
    with pytest.raises(ValueError, match=rf"every_n_train_steps={bad!r} is not allowed: use an int >= 0"):
        LastCheckpoint(every_n_train_steps=bad)


def test_a_second_run_into_the_same_dirpath_overwrites_last_ckpt_instead_of_writing_last_v1(tmp_path):
    folder = tmp_path / "checkpoints"
    _fit(tmp_path, [LastCheckpoint(dirpath=str(folder))], max_epochs=1)  # 4 steps
    first = torch.load(folder / "last.ckpt", weights_only=True)["global_step"]
    _fit(tmp_path, [LastCheckpoint(dirpath=str(folder))], max_epochs=2)  # a new run, 8 steps, same folder
    assert first == 4
    assert sorted(path.name for path in folder.iterdir()) == ["last.ckpt"]  # no last-v1.ckpt beside an old one
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 8  # the second run's state
