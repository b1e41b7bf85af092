"""``TensorSubclassCheckpointIO``: Lightning's checkpoint IO that loads tensor subclasses (torchao's 8-bit state).

The end-to-end resumes that need it: tests/test_eightbit_step.py (a Trainer fit resumed bitwise, normal and inside
backward) and tests/test_fabric.py (``fabric.save`` / ``fabric.load`` bitwise, and the message without it).
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO

from lightning_mp import TensorSubclassCheckpointIO
from lightning_mp.checkpoints.io import REFUSAL

torchao_subclass = pytest.importorskip("torchao.optim.subclass_8bit")


@pytest.fixture
def saved(tmp_path):
    state = torchao_subclass.OptimState8bit.zeros((4096,), signed=True)
    state.copy_(torch.linspace(-1, 1, 4096))
    path = tmp_path / "state.ckpt"
    torch.save({"exp_avg": state, "step": torch.tensor(3.0)}, path)
    return path, state


def test_lightnings_own_checkpoint_io_cannot_load_a_tensor_subclass(saved):
    """Why the class exists: Lightning's default ``map_location`` (a callable) is refused by torch for a wrapper
    subclass. (If an upgrade of Lightning or torch fixes this, the class can go.)"""
    with pytest.raises(RuntimeError, match=REFUSAL):
        TorchCheckpointIO().load_checkpoint(saved[0])


def test_it_loads_the_subclass_on_the_cpu_bitwise_and_keeps_a_map_location_it_is_given(saved):
    path, state = saved
    for map_location in (None, "cpu", {"cpu": "cpu"}):
        loaded = TensorSubclassCheckpointIO().load_checkpoint(path, map_location=map_location)
        moment = loaded["exp_avg"]
        assert type(moment) is type(state) and moment.device.type == "cpu"
        assert torch.equal(moment.codes, state.codes) and torch.equal(moment.scale, state.scale)
        assert float(loaded["step"]) == 3.0
    assert isinstance(TensorSubclassCheckpointIO(), TorchCheckpointIO)  # saves, removes and names as Lightning's


def test_the_standalone_packages_class_is_their_checkpoint_io_with_the_same_load(saved):
    pytest.importorskip("pytorch_lightning")
    from lightning_fabric.plugins import TorchCheckpointIO as StandaloneIO

    from lightning_mp.pytorch_lightning import TensorSubclassCheckpointIO as Standalone

    assert isinstance(Standalone(), StandaloneIO)
    loaded = Standalone().load_checkpoint(saved[0])
    assert torch.equal(loaded["exp_avg"].codes, saved[1].codes)


@pytest.mark.parametrize(
    ("optimizer", "io", "warned"), [("AdamW8bit", None, True), ("AdamW8bit", "subclass", False), ("AdamW", None, False)]
)
def test_a_run_whose_checkpoints_would_not_load_back_is_warned_at_connect(optimizer, io, warned):
    """Before the first checkpoint is written: torchao's optimizer under Lightning's own checkpoint IO warns, naming
    the class to pass; with it, or with torch's AdamW, nothing is said."""
    import warnings

    import lightning as L
    from torch import nn

    from lightning_mp import MixedPrecisionPlugin

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            if optimizer == "AdamW":
                return torch.optim.AdamW(self.parameters())
            return pytest.importorskip("torchao.optim").AdamW8bit(self.parameters())

    plugins = [MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")]
    plugins += [TensorSubclassCheckpointIO()] if io else []
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=1, plugins=plugins, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 8)), batch_size=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Net(), loader)
    said = [str(w.message) for w in caught if "TensorSubclassCheckpointIO" in str(w.message)]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert (
            said[0].startswith("AdamW8bit keeps its state in tensor subclasses") and "Trainer(plugins=[...])" in said[0]
        )
