"""The exact weights of any module the plugin holds, found from its parameters: a diffusers UNet inside the
LightningModule (diffusers' own ``EMAModel`` over ``exact_weights(self.unet)``), a module reached by any path, under
the Trainer and Fabric, in every master mode; a module the plugin does not hold is refused by name, never given as
its 16-bit values; without master weights the parameters are the exact weights. Reference: the masters themselves
(``tests.test_weight_averaging.RecordExact`` checks each read against the fp32 masters or the bf16 weight joined
with its remainder), averaged in float64 in the test."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master import exact_parameters, exact_weights
from lightning_mp.master.exact import NotHeldError
from lightning_mp.master.model_sync import ModelSync, holder_of
from tests.helpers import fabric_trained_net
from tests.test_weight_averaging import IDS, MODES, RecordExact


def tiny_unet() -> nn.Module:
    from diffusers import UNet2DModel

    return UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )


class Denoiser(L.LightningModule):
    """A diffusion training step as diffusers' scripts write it, with the UNet as a submodule and a head outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.unet = tiny_unet()
        self.head = nn.Conv2d(1, 1, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (images,) = batch
        noise = torch.randn_like(images)
        steps = torch.arange(images.shape[0]) * 97
        predicted = self.head(self.unet(images + noise, steps).sample)
        return nn.functional.mse_loss(predicted.float(), noise)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


class UnetEma(L.Callback):
    """diffusers' ``EMAModel`` over the UNet only, as its training scripts hold one: built from the fp32 UNet before
    training, ``step`` after each optimizer step, ``copy_to`` at the end; both through ``exact_weights(self.unet)``."""

    def __init__(self, unet: nn.Module) -> None:
        from diffusers.training_utils import EMAModel

        self.ema = EMAModel(unet.parameters(), decay=0.9, foreach=True)
        self.decays: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        with exact_weights(pl_module.unet, write=False) as unet:
            self.ema.step(unet.parameters())
        self.decays.append(self.ema.cur_decay_value)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        with exact_weights(pl_module.unet) as unet:
            self.ema.copy_to(unet.parameters())


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_diffusers_ema_model_on_the_unet_submodule_is_exact(mode):
    torch.manual_seed(0)
    model = Denoiser()
    names = [name for name, _ in model.unet.named_parameters()]
    initial = {name: p.detach().double().clone() for name, p in model.unet.named_parameters()}
    callback, record = UnetEma(model.unet), RecordExact()
    master_weights, in_backward = mode
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights, optimizer_in_backward=in_backward)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[plugin],
                        callbacks=[record, callback])  # fmt: skip
    images = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    trainer.fit(model, DataLoader(TensorDataset(images), batch_size=4))
    assert len(record.steps) == 4 and record.bf16_differs  # the 16-bit copies differ: the test can tell them apart
    reference = initial
    for decay, step in zip(callback.decays, record.steps):
        reference = {name: decay * reference[name] + (1 - decay) * step[f"unet.{name}"] for name in names}
    assert callback.decays[0] == 0.0 and callback.decays[-1] > 0.3  # diffusers' warm-up: the average moves
    shadow = dict(zip(names, callback.ema.shadow_params))
    assert all(shadow[name].dtype == torch.float32 for name in names)
    for name in names:
        assert (shadow[name].double() - reference[name]).abs().max().item() <= 1e-6, name
        # copy_to at train end: the UNet holds the average, fp32 again after fit
        assert (model.unet.get_parameter(name).double() - reference[name]).abs().max().item() <= 1e-6, name


def set_up(master_weights: Any, model: nn.Module) -> MixedPrecisionPlugin:
    """The plugin set up on ``model`` without a Trainer (convert, connect), as ``docs/master-weights.md`` shows."""
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights)
    plugin.convert_module(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    plugin.connect(model, [optimizer], [])
    return plugin


def truth(plugin: MixedPrecisionPlugin, param: nn.Parameter) -> torch.Tensor:
    """The exact value from the model's state_dict hook (the fp32 masters the plugin saves)."""
    return plugin.masters.fp32_value(param)


@pytest.mark.parametrize("master_weights", [True, "remainder"])
def test_a_module_reached_by_any_path_gives_its_exact_values_and_takes_writes(master_weights):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.Linear(8, 2))
    plugin = set_up(master_weights, model)
    saved = model.state_dict()  # the exact fp32 values (the state-dict hook)
    inner = model[1]
    holder = {"deep": inner}  # a module held in a plain dict: found from its parameters, not from a path
    for module, prefix in ((holder["deep"], "1."), (model[2], "2."), (model[1][1], "1.1.")):
        read = dict(exact_parameters(module))
        assert read.keys() == {name.removeprefix(prefix) for name in saved if name.startswith(prefix)}
        assert all(torch.equal(read[name], saved[prefix + name]) for name in read)
    assert not torch.equal(inner[0].weight.detach().float(), saved["1.0.weight"])  # the 16-bit copy differs
    assert inner[1].weight.dtype == torch.float32  # kept in fp32 (LayerNorm): held, given as it is
    targets = {name: torch.randn(p.shape) for name, p in inner.named_parameters()}
    with exact_weights(inner) as fp32:
        for name, param in fp32.named_parameters():
            param.data.copy_(targets[name])  # invisible to the masters outside this context
    assert all(torch.equal(value, targets[name]) for name, value in plugin.exact_parameters(inner))
    assert all(torch.equal(model.state_dict()[f"1.{name}"], target) for name, target in targets.items())


@pytest.mark.parametrize("master_weights", [True, "remainder"])
def test_a_module_the_plugin_does_not_hold_is_refused_by_name(master_weights):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    plugin = set_up(master_weights, model)
    stranger = nn.GRU(3, 3).to(torch.bfloat16)  # never set up by the plugin: 16-bit values of nothing it holds
    with pytest.raises(NotHeldError, match=r"do not hold GRU \(parameters weight_ih_l0, weight_hh_l0, bias_ih_l0, "
                                           r"\.\.\.; bfloat16\).*Pass the model the plugin trains"):  # fmt: skip
        list(plugin.exact_parameters(stranger))
    with pytest.raises(NotHeldError, match="do not hold GRU"), plugin.exact_weights(stranger):
        pass
    assert all(p.dtype == torch.bfloat16 for p in stranger.parameters())  # nothing swapped in or written
    # the free functions take the module the plugin holds, whatever reached it
    assert all(torch.equal(v, truth(plugin, p)) for (_, v), p in zip(exact_parameters(model[1]), model[1].parameters()))


def test_the_plugin_found_through_the_trainer_refuses_a_module_it_does_not_hold(tmp_path):
    # a LightningModule run by a Trainer whose plugin holds another model: refused, not read as it is
    from tests.test_weight_averaging import Net, loader

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, plugins=[plugin])  # fmt: skip
    seen: dict[str, Any] = {}

    class Probe(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
            other = Net()
            other._trainer = trainer  # run by the same Trainer, never set up by its plugin
            with pytest.raises(NotHeldError, match="do not hold Net"):
                list(exact_parameters(other))
            seen["read"] = dict(exact_parameters(pl_module.net))

    trainer.callbacks.append(Probe())
    model = Net()
    trainer.fit(model, loader(1))
    assert seen["read"].keys() == {name for name, _ in model.net.named_parameters()}


@pytest.mark.parametrize("master_weights", [True, "remainder"])
def test_a_submodule_under_fabric(master_weights):
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights)
    _, net = fabric_trained_net(plugin)
    saved = net.state_dict()  # the exact fp32 masters
    last = net.module[2]
    read = dict(exact_parameters(last))
    assert all(torch.equal(read[name], saved[f"2.{name}"]) for name in ("weight", "bias"))
    assert not torch.equal(read["weight"], last.weight.detach().float())
    with exact_weights(last) as fp32:
        fp32.weight.data.fill_(0.123456789)
    assert torch.equal(net.state_dict()["2.weight"], torch.full((2, 8), 0.123456789))
    with pytest.raises(NotHeldError, match="do not hold Linear"):
        list(plugin.exact_parameters(nn.Linear(2, 2)))


def test_without_master_weights_the_parameters_are_the_exact_weights():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=False)
    plugin.convert_module(model)
    plugin.connect(model, [torch.optim.SGD(model.parameters(), lr=0.1)], [])
    for module in (model, model[1], nn.Linear(2, 2)):  # no masters: nothing is refused, nothing is a copy
        pairs = list(zip(plugin.exact_parameters(module), module.parameters()))
        assert pairs and all(torch.equal(value, param) for (_, value), param in pairs)
        with plugin.exact_weights(module) as inner:
            assert [id(p) for p in inner.parameters()] == [id(p) for p in module.parameters()]


def test_the_registry_forgets_at_teardown_and_keeps_nothing_alive():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    plugin = set_up("remainder", model)
    sync = plugin.masters.model_sync
    assert all(holder_of(p) is sync for p in model.parameters())  # the LayerNorm's fp32 ones too
    plugin.teardown()  # the model is fp32 again: its parameters are the exact values, held by no masters
    assert all(holder_of(p) is None for p in model.parameters())
    assert all(v.dtype == torch.float32 for _, v in plugin.exact_parameters(model[0]))
    # the registry's references are weak on both sides: a store dropped without teardown, and its parameters, are
    # freed (a ModelSync over a store stand-in: no hooks, so nothing but the registry could keep them)
    store, module = nn.Identity(), nn.Linear(3, 3)
    held = ModelSync(store, module, {})
    assert holder_of(module.weight) is held
    dead_sync, dead_store, dead_param = weakref.ref(held), weakref.ref(store), weakref.ref(module.weight)
    del held, store
    gc.collect()
    assert dead_sync() is None and dead_store() is None and holder_of(module.weight) is None
    del module
    gc.collect()
    assert dead_param() is None
