"""Property: random sequences of writes into a set-up model never leave the masters behind.

Each example draws a master mode, Trainer or Fabric, and a sequence of writes (kind x target module x moment: after
setup, between steps, in a Trainer hook or a callback, after a ``fabric.load`` resume). Steps run at lr 0, so the fp32
master reference is the model's fp32 values before setup updated by each write (:func:`tests.model_writes.write`
returns what each leaves); the checkpoint written after the last step must equal it bitwise.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning as L
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from tests.model_writes import (
    KINDS,
    MODES,
    TARGETS,
    Net,
    assert_exact,
    fit_with_writes,
    followed,
    loader,
    plugin,
    snapshot,
    write,
    zero_lr_optimizer,
)

pytest.importorskip("litgpt")

SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
TRAINER_MOMENTS = ("on_train_start", "callback", "batch_end")
STEPS = 3


def _fabric_run(mode, writes, resume_at, tmp_path: Path) -> None:
    """Writes ``(step, kind, target)`` before the step of that number; with ``resume_at``, the state saved after step
    0 is loaded back (``fabric.load``) before the step of that number, ahead of its writes."""
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin(mode)])
    model = Net()
    reference = snapshot(model)
    optimizer = zero_lr_optimizer(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    x, y = next(iter(loader(1)))
    saved_reference = None
    for step in range(STEPS):
        if step == resume_at:
            fabric.load(tmp_path / "step0.ckpt", {"model": model, "optimizer": optimizer})
            reference = dict(saved_reference)
        for number, (when, kind, target) in enumerate(writes):
            if when == step:
                reference.update(followed(mode, reference, write(kind, model.module, target, tmp_path, seed=number)))
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            fabric.save(tmp_path / "step0.ckpt", {"model": model, "optimizer": optimizer})
            saved_reference = dict(reference)
    fabric.save(tmp_path / "last.ckpt", {"model": model})
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["model"]
    assert_exact(saved, reference, f"Fabric, master_weights={mode!r}, writes {writes}, resume at {resume_at}")


write_kinds = st.sampled_from(KINDS)
targets = st.sampled_from(TARGETS)


@settings(SETTINGS, max_examples=200)
@given(
    mode=st.sampled_from(MODES),
    writes=st.lists(st.tuples(st.integers(0, STEPS - 1), write_kinds, targets), min_size=1, max_size=4),
    resume_at=st.sampled_from([None, 1, 2]),
)
# a parameter replaced on the module, then a resume (new group dicts): the optimizer's original is still held
@example(mode="remainder", writes=[(1, "replace", "root")], resume_at=1)
def test_fabric_write_sequences_match_the_fp32_master_reference(mode, writes, resume_at):
    with tempfile.TemporaryDirectory() as directory:
        _fabric_run(mode, writes, resume_at, Path(directory))


@settings(SETTINGS, max_examples=100)
@given(
    mode=st.sampled_from(MODES),
    writes=st.lists(st.tuples(st.sampled_from(TRAINER_MOMENTS), write_kinds, targets), min_size=1, max_size=4),
)
def test_trainer_write_sequences_match_the_fp32_master_reference(mode, writes):
    with tempfile.TemporaryDirectory() as directory:
        module = fit_with_writes(mode, writes, Path(directory), steps=STEPS)
        assert_exact(module.saved, module.expected, f"Trainer, master_weights={mode!r}, writes {writes}")
