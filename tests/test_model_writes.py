"""Every write into a set-up model reaches the master weights, or fails loudly naming the parameter.

The matrix of docs/master-weights.md ("Writes after setup"): write kind x target (a parameter of the root module, or
of a child module) x Trainer (writes in ``on_train_start``, in a callback, between steps) and Fabric (after
``fabric.setup``, between steps) x master mode. Steps run at lr 0, so the fp32 weights that
``trainer.save_checkpoint`` / ``fabric.save`` write must be bitwise the values written (the fp32 reference: the
loaded or carried fp32 values, the model's 16-bit value after a write in place) and, elsewhere, the fp32 values the
model had before setup.
"""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from torch import nn

from lightning_mp.master.model_sync import ModelWriteError
from tests.model_writes import (
    KINDS,
    MODES,
    TARGETS,
    Net,
    assert_exact,
    fabric_with_writes,
    fit_with_writes,
    followed,
    loader,
    plugin,
    snapshot,
    write,
    zero_lr_optimizer,
)

pytest.importorskip("litgpt")


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", KINDS)
def test_trainer_masters_follow_each_write(kind, target, mode, tmp_path):
    other = "root" if target == "child" else "child"
    writes = [("on_train_start", kind, target), ("callback", kind, target), ("batch_end", kind, other)]
    module = fit_with_writes(mode, writes, tmp_path)
    assert_exact(module.saved, module.expected, f"Trainer, master_weights={mode!r}, writes {writes}")
    # after fit the model holds the masters' exact fp32 values (what save_pretrained would write)
    assert_exact(snapshot(module), module.expected, "the model after fit")


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kind", KINDS)
def test_fabric_masters_follow_each_write(kind, target, mode, tmp_path):
    other = "root" if target == "child" else "child"
    fabric_with_writes(mode, [(0, kind, target), (1, kind, target), (2, kind, other)], tmp_path)


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
@pytest.mark.parametrize("kind", ["load_lazy", "init", "data"])
def test_trainer_masters_follow_writes_after_a_resume(kind, mode, tmp_path):
    first = fit_with_writes(mode, [("batch_end", "load", "child")], tmp_path)
    resumed_path = tmp_path / "resumed.ckpt"
    (tmp_path / "trainer.ckpt").rename(resumed_path)
    writes = [("on_train_start", kind, "root"), ("callback", kind, "child")]
    module = fit_with_writes(mode, writes, tmp_path, steps=6, ckpt_path=resumed_path)
    assert module.saved.keys() == first.saved.keys()
    assert_exact(module.saved, module.expected, f"Trainer resumed, master_weights={mode!r}, writes {writes}")


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
def test_fabric_module_set_up_without_optimizer_follows_writes(mode, tmp_path):
    # no optimizer: the masters are the values kept at the cast (connected at the first forward)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin(mode)])
    model = Net()
    expected = snapshot(model)
    model = fabric.setup_module(model)
    expected.update(followed(mode, expected, write("load_lazy", model.module, "child", tmp_path)))
    expected.update(followed(mode, expected, write("init", model.module, "root", tmp_path, seed=1)))
    model(next(iter(loader(1)))[0])
    expected.update(followed(mode, expected, write("mul", model.module, "child", tmp_path, seed=2)))
    assert_exact(model.module.state_dict(), expected, f"Fabric setup_module, master_weights={mode!r}")


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
def test_new_storage_twice_is_followed_even_where_the_allocator_reuses_the_address(mode):
    # p.data = t frees the storage recorded at the last step; a second p.data = t2 of the same size may get that
    # address back: the recorded storages are held, so the address cannot come back while it is recorded
    fabric, model, optimizer = _fabric_model(mode)
    weight = model.module.net[2].weight
    for value in (1.0, 2.0, 3.0):
        weight.data = torch.full((3, 6), value, dtype=torch.bfloat16)
    _step(model, optimizer, fabric)
    assert torch.equal(model.module.state_dict()["net.2.weight"], torch.full((3, 6), 3.0))


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
def test_new_storage_then_a_load_keeps_the_parameter_in_the_plugins_storage(mode, tmp_path):
    # found by the property test: p.data = t, then a load of the same parameter, then a write in place
    fabric, model, optimizer = _fabric_model(mode)
    inner = model.module
    expected = snapshot(inner)
    expected.update(followed(mode, expected, write("data", inner, "root", tmp_path)))
    expected.update(followed(mode, expected, write("load", inner, "root", tmp_path, seed=1)))
    _step(model, optimizer, fabric)
    expected.update(followed(mode, expected, write("init", inner, "root", tmp_path, seed=2)))
    _step(model, optimizer, fabric)
    assert inner.scale.dtype == torch.bfloat16
    assert_exact(inner.state_dict(), expected, f"master_weights={mode!r}")


def _fabric_model(mode):
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin(mode)])
    model = Net()
    model, optimizer = fabric.setup(model, zero_lr_optimizer(model.parameters()))
    return fabric, model, optimizer


def _step(model, optimizer, fabric):
    x, y = next(iter(loader(1)))
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    optimizer.step()


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
@pytest.mark.parametrize(
    "write, problem",
    [
        (lambda m: setattr(m.net[2].weight, "data", torch.zeros(2, 2)), "shape is now (2, 2)"),
        (lambda m: setattr(m.net[2], "weight", nn.Parameter(torch.zeros(3, 5))), "shape is now (3, 5)"),
        (
            lambda m: setattr(
                m.net[2], "weight", nn.Parameter(torch.zeros(3, 6, dtype=torch.int32), requires_grad=False)
            ),
            "not a floating dtype",
        ),
        (lambda m: setattr(m.net[2], "weight", None), "removed"),
        (lambda m: delattr(m.net[2], "weight"), "removed"),
    ],
    ids=["data-shape", "replace-shape", "replace-int", "set-none", "deleted"],
)
def test_a_write_the_masters_cannot_follow_fails_at_the_next_step_naming_the_parameter(mode, write, problem):
    # written between the backward and the step (a forward after such a write would fail first, in torch)
    fabric, model, optimizer = _fabric_model(mode)
    x, y = next(iter(loader(1)))
    fabric.backward(nn.functional.mse_loss(model(x).float(), y))
    write(model.module)
    with pytest.raises(ModelWriteError, match=r"'net\.2\.weight'.*" + re.escape(problem) + r".*param\.copy_\(value\)"):
        optimizer.step()


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
def test_trainer_raises_for_a_write_it_cannot_follow(mode, tmp_path):
    class Reshaping(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            if trainer.global_step == 1:
                pl_module.net[0].bias.data = torch.zeros(7)

    from tests.model_writes import WritingModule

    trainer = L.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[plugin(mode)], callbacks=[Reshaping()],
    )  # fmt: skip
    with pytest.raises(ModelWriteError, match=r"'net\.0\.bias'.*shape is now \(7,\)"):
        trainer.fit(WritingModule([], tmp_path), loader(3))


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
def test_replaced_parameter_object_is_put_back_and_keeps_training(mode):
    # the optimizer holds the object the masters belong to: the module gets it back, holding the new value
    fabric, model, optimizer = _fabric_model(mode)
    inner = model.module
    original = inner.net[0].weight
    inner.net[0].weight = nn.Parameter(torch.full((6, 4), 0.25))
    _step(model, optimizer, fabric)
    assert inner.net[0].weight is original
    assert torch.equal(inner.state_dict()["net.0.weight"], torch.full((6, 4), 0.25))
    assert inner.net[0].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", MODES, ids=["fp32", "remainder"])
def test_data_copy_bumps_nothing_and_is_the_documented_exception(mode):
    # p.data.copy_(t) changes no version counter and no storage: nothing records it (docs: "Writes after setup");
    # the supported write, p.copy_(t) under no_grad, is followed (test_*_masters_follow_each_write, kind "copy")
    fabric, model, optimizer = _fabric_model(mode)
    written = torch.full((6, 4), 2.0)
    model.module.net[0].weight.data.copy_(written)
    fabric._precision.follow_model_writes()
    assert not torch.equal(model.module.state_dict()["net.0.weight"], written)


def test_a_step_without_writes_changes_no_record():
    # the plugin's own writes (masters back into the model, the lean update) are not taken for user writes
    for mode in MODES:
        fabric, model, optimizer = _fabric_model(mode)
        sync = fabric._precision.masters.model_sync
        for _ in range(3):
            _step(model, optimizer, fabric)
            assert sync.unchanged()
