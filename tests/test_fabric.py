"""The plugin in ``L.Fabric(plugins=[MixedPrecisionPlugin(...)])``, one device: the loop as users write it.

The main reference is the Trainer path itself: the same model, data, options and plugin settings, trained by a
``Trainer`` and by a Fabric loop, must end bitwise equal (fp32 values, scaler state). Every exactness property of the
Trainer path (masters against fp32, skips, accumulation in fp32, clipping on unscaled gradients) then holds on the
Fabric path as well. The 2-rank runs are in ``test_fabric_distributed.py``.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, TensorSubclassCheckpointIO
from tests.helpers import make_trainer, seeded

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

STEPS_DATA = 64  # 8 batches of 8


def build(width: int = 32) -> nn.Module:
    with seeded():
        return nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1))


#: torchao's AdamW8bit: 8-bit moments for the 16 x 256 weight (4096 elements), fp32 ones for the rest
WIDTH = {"adamw8bit": 256}


def batches(inject: tuple[int, ...] = ()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """8 batches of 8; the batches numbered in ``inject`` hold an inf (their gradients are non-finite)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS_DATA, 16, generator=generator)
    y = x.sum(1, keepdim=True)
    out = []
    for i in range(STEPS_DATA // 8):
        xb = x[8 * i : 8 * i + 8].clone()
        if i in inject:
            xb[0, 0] = float("inf")
        out.append((xb, y[8 * i : 8 * i + 8]))
    return out


def make_optimizer(params: Any, name: str) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "adamw8bit":  # torchao's, in one pass with master_weights="remainder"
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, lr=1e-2, weight_decay=0.1)
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)


class TrainerNet(L.LightningModule):
    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.net = build(WIDTH.get(optimizer, 32))
        self.optimizer_name = optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.parameters(), self.optimizer_name)


def trainer_run(plugin: MixedPrecisionPlugin, optimizer: str, accumulate: int, clip: Any, inject: tuple) -> Any:
    model = TrainerNet(optimizer)
    kwargs: dict[str, Any] = dict(accumulate_grad_batches=accumulate)
    if clip is not None:
        kwargs.update(gradient_clip_val=clip[1], gradient_clip_algorithm=clip[0])
    x = torch.cat([b[0] for b in batches(inject)])
    y = torch.cat([b[1] for b in batches(inject)])
    make_trainer(plugin, **kwargs).fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    return [p.detach().clone() for p in model.net.state_dict().values()]


def fabric_loop(
    fabric: L.Fabric, model: Any, optimizer: Any, data: list, accumulate: int = 1, clip: Any = None, start: int = 0
) -> list[float]:
    """The loop as a Fabric user writes it: forward, ``fabric.backward``, clipping, ``step``, ``zero_grad``;
    gradient accumulation under ``fabric.no_backward_sync``."""
    losses = []
    for i, (x, y) in enumerate(data[start:], start=start):
        last = (i + 1) % accumulate == 0
        with fabric.no_backward_sync(model, enabled=not last):
            loss = nn.functional.mse_loss(model(x).float(), y)
            fabric.backward(loss / accumulate if accumulate > 1 else loss)
        losses.append(loss.item())
        if not last:
            continue
        if clip is not None:
            kind, value = clip
            fabric.clip_gradients(model, optimizer, **({"max_norm": value} if kind == "norm" else {"clip_val": value}))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def fabric_run(
    plugin: MixedPrecisionPlugin, optimizer: str, accumulate: int, clip: Any, inject: tuple
) -> list[torch.Tensor]:
    model = build(WIDTH.get(optimizer, 32))
    opt = make_optimizer(model.parameters(), optimizer)  # built before fabric.setup, on the fp32 parameters
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric_loop(fabric, model, opt, batches(inject), accumulate, clip)
    return [p.detach().clone() for p in model.state_dict().values()]


def _plugin(precision: str, masters: Any, fp8: Any = None) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin(precision, master_weights=masters, fp8=fp8)


CASES = [
    # precision, master_weights, optimizer, accumulate, clip, inject
    ("bf16-mixed", "remainder", "adamw", 1, None, ()),
    ("bf16-mixed", "remainder", "adamw", 2, ("norm", 0.5), ()),
    ("bf16-mixed", "remainder", "sgd", 1, ("value", 0.05), (3,)),
    ("bf16-mixed", True, "adamw", 2, ("norm", 0.5), (2,)),
    ("bf16-mixed", True, "sgd", 1, ("value", 0.05), ()),
    ("bf16-mixed", False, "adamw", 1, ("norm", 0.5), (1,)),
    ("16-mixed", True, "adamw", 1, ("norm", 0.5), (2, 3)),
    ("16-mixed", False, "sgd", 2, None, (4,)),
    ("bf16-mixed", "remainder", "adamw", 1, ("norm", 0.5), ("fp8", 2)),
    ("bf16-mixed", "remainder", "adamw8bit", 2, ("norm", 0.5), (3,)),
    ("bf16-mixed", "remainder", "adamw8bit", 1, ("value", 0.05), ()),
]


@pytest.mark.parametrize(("precision", "masters", "optimizer", "accumulate", "clip", "inject"), CASES)
def test_fabric_loop_ends_bitwise_where_the_trainer_ends(precision, masters, optimizer, accumulate, clip, inject):
    """Same model, data and settings: the Fabric loop's fp32 values and scaler state equal the Trainer's, bitwise,
    with skips (an inf in a batch), fp32 accumulation under ``no_backward_sync``, both clipping forms and fp8
    (torchao's emulated float8 on CPU; ``inject`` then starts with ``"fp8"``)."""
    fp8 = None
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao.optim")
    if inject and inject[0] == "fp8":
        pytest.importorskip("torchao")
        fp8, inject = "tensorwise", inject[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_plugin, fabric_plugin = _plugin(precision, masters, fp8), _plugin(precision, masters, fp8)
        expected = trainer_run(trainer_plugin, optimizer, accumulate, clip, inject)
        got = fabric_run(fabric_plugin, optimizer, accumulate, clip, inject)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert fabric_plugin.state_dict() == trainer_plugin.state_dict()
    if fp8 is not None:
        assert fabric_plugin.fp8 is not None and fabric_plugin.fp8.converted == ["0"]  # trained in fp8
    assert fabric_plugin.scaler.state_dict()["skipped_steps"] >= len(inject)  # fp16: also the first scale's


@pytest.mark.parametrize("masters", [True, "remainder"])
def test_optimizer_built_before_setup_updates_the_exact_fp32_values(masters):
    """Updates far below half a bf16 spacing (lr 1e-5) are kept: the fp32 values the user's optimizer (built before
    ``fabric.setup``) updates are those of an fp32 replay of the same gradients, bitwise; bf16 weights alone would
    not move."""
    model = build()
    initial = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=masters)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(model, opt)
    assert next(model.parameters()).dtype == torch.bfloat16
    if masters is True:  # the optimizer now holds fp32 masters with the exact initial values, in place
        held = [p for g in opt.param_groups for p in g["params"]]
        assert all(p.dtype == torch.float32 for p in held)
        assert all(torch.equal(p, q) for p, q in zip(held, initial))
    seen = []
    for x, y in batches():
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        seen.append([p.grad.detach().float().clone() for g in opt.param_groups for p in g["params"]])
        opt.step()
        opt.zero_grad()
    params = [nn.Parameter(p.clone()) for p in initial]
    reference = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=masters == "remainder")
    for grads in seen:
        for param, grad in zip(params, grads):
            param.grad = grad
        reference.step()
    values = list(model.state_dict().values())
    for value, param in zip(values, params):
        assert torch.equal(value, param.detach())
    # the change is real in fp32 and lost in bf16 for most weights
    first = values[0]
    assert not torch.equal(first, initial[0])
    assert torch.equal(first.bfloat16(), initial[0].bfloat16()) or (first != initial[0]).float().mean() > 0.5


def test_precision_string_together_with_the_plugin_is_one_clear_error():
    with pytest.raises(ValueError, match=r"Received both `precision=bf16-mixed` and `plugins=.*Choose one"):
        L.Fabric(accelerator="cpu", precision="bf16-mixed", plugins=[MixedPrecisionPlugin("bf16-mixed")])


@pytest.mark.parametrize("masters", [True, "remainder"])
def test_setup_module_then_setup_optimizers_with_two_optimizers_equals_one_setup(masters):
    """``setup_module`` + ``setup_optimizers(opt1, opt2)`` trains as ``setup(model, opt1, opt2)``, bitwise."""
    results = []
    for form in ("joint", "separate"):
        model = build()
        opt1 = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
        opt2 = torch.optim.SGD([*model[1].parameters(), *model[3].parameters()], lr=1e-2, momentum=0.9)
        fabric = L.Fabric(
            accelerator="cpu", devices=1, plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights=masters)]
        )
        if form == "joint":
            model, opt1, opt2 = fabric.setup(model, opt1, opt2)
        else:
            model = fabric.setup_module(model)
            opt1, opt2 = fabric.setup_optimizers(opt1, opt2)
        for x, y in batches()[:4]:
            fabric.backward(nn.functional.mse_loss(model(x).float(), y))
            for opt in (opt1, opt2):
                opt.step()
                opt.zero_grad()
        results.append(list(model.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _resume_run(
    tmp_path: Any, masters: Any, precision: str, interrupt: Optional[int], plugin_in_state: bool, optimizer: str
) -> Any:
    """8 steps; with ``interrupt``, stop after that many, save, build everything anew, load, and finish."""
    data = batches(inject=(2,))

    def fresh() -> tuple[L.Fabric, Any, Any, MixedPrecisionPlugin]:
        model = build(WIDTH.get(optimizer, 32))
        opt = make_optimizer(model.parameters(), optimizer)
        plugin = MixedPrecisionPlugin(precision, master_weights=masters)
        io = [TensorSubclassCheckpointIO()] if optimizer == "adamw8bit" else []  # torchao's state: tensor subclasses
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin, *io])
        model, opt = fabric.setup(model, opt)
        return fabric, model, opt, plugin

    fabric, model, opt, plugin = fresh()
    if interrupt is None:
        fabric_loop(fabric, model, opt, data, clip=("norm", 0.5))
        return list(model.state_dict().values()), plugin.state_dict()
    fabric_loop(fabric, model, opt, data[:interrupt], clip=("norm", 0.5))
    state: dict[str, Any] = {"model": model, "optimizer": opt, "step": interrupt}
    if plugin_in_state:
        state["precision"] = plugin
    fabric.save(tmp_path / "ckpt.pt", state)
    fabric, model, opt, plugin = fresh()
    state = {"model": model, "optimizer": opt}
    if plugin_in_state:
        state["precision"] = plugin
    remainder = fabric.load(tmp_path / "ckpt.pt", state)
    assert remainder == {"step": interrupt}  # the plugin's own entry is restored, not returned
    fabric_loop(fabric, model, opt, data, clip=("norm", 0.5), start=interrupt)
    return list(model.state_dict().values()), plugin.state_dict()


@pytest.mark.parametrize(
    ("precision", "masters", "plugin_in_state", "optimizer"),
    [
        ("bf16-mixed", True, False, "adamw"),
        ("bf16-mixed", "remainder", False, "adamw"),
        ("bf16-mixed", "remainder", True, "adamw"),
        ("16-mixed", True, False, "adamw"),
        ("bf16-mixed", "remainder", False, "adamw8bit"),
    ],
)
def test_load_after_an_interrupted_run_resumes_bit_exactly(tmp_path, precision, masters, plugin_in_state, optimizer):
    """``fabric.save`` / ``fabric.load`` with ``state`` holding only the model and the optimizer (the plugin's
    scaler state travels by itself under ``"MixedPrecisionPlugin"``) or the plugin as well; torchao's AdamW8bit in one
    pass too (its 8-bit state saved and loaded)."""
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao.optim")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        whole, whole_scaler = _resume_run(tmp_path, masters, precision, None, plugin_in_state, optimizer)
        resumed, resumed_scaler = _resume_run(tmp_path, masters, precision, 5, plugin_in_state, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    assert resumed_scaler == whole_scaler


def test_loading_torchaos_8bit_state_without_the_subclass_checkpoint_io_says_what_to_pass(tmp_path):
    """Lightning's own checkpoint IO cannot load torchao's 8-bit state (torch refuses its callable map_location for
    tensor subclasses, with or without the plugin): ``fabric.load`` says so and names the class that loads it."""
    pytest.importorskip("torchao.optim")
    model = build(WIDTH["adamw8bit"])
    fabric = L.Fabric(
        accelerator="cpu", devices=1, plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")]
    )
    model, opt = fabric.setup(model, make_optimizer(model.parameters(), "adamw8bit"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric_loop(fabric, model, opt, batches()[:2])
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt})
    with pytest.raises(RuntimeError, match=r"Pass lightning_mp.TensorSubclassCheckpointIO\(\) in Fabric\(plugins="):
        fabric.load(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt})


@pytest.mark.parametrize("masters", [True, "remainder"])
def test_saved_model_holds_fp32_masters_that_load_strictly_into_an_fp32_model(tmp_path, masters):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=masters)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(model, opt)
    fabric_loop(fabric, model, opt, batches()[:3])
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": opt})
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["MixedPrecisionPlugin"] == plugin.state_dict()
    plain = build()
    plain.load_state_dict(saved["model"], strict=True)
    assert all(v.dtype == torch.float32 for v in saved["model"].values())
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))


def test_fp16_static_scale_skips_and_the_consecutive_skip_limit_raises():
    plugin = MixedPrecisionPlugin("16-mixed", scaler=DynamicLossScaler.static(8.0, max_consecutive_skips=2))
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric_loop(fabric, model, opt, batches(inject=(1,))[:3])
        assert plugin.scaler.state_dict()["skipped_steps"] == 1 and plugin.scaler.scale == 8.0
        with pytest.raises(FloatingPointError, match="2 non-finite optimizer steps in a row|in a row"):
            fabric_loop(fabric, model, opt, batches(inject=(3, 4))[3:5])


def test_clip_gradients_sees_unscaled_gradients_and_a_skipped_step_does_not_raise():
    plugin = MixedPrecisionPlugin("16-mixed", master_weights=True, scaler={"init_scale": 1024.0})
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt = fabric.setup(model, opt)
    x, y = batches()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        norm = fabric.clip_gradients(model, opt, max_norm=1e9)
        true = torch.linalg.vector_norm(torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]]))
        assert plugin.scaler.scale > 1000 and torch.allclose(norm, true) and float(norm) < 1000
        opt.step()
        opt.zero_grad()
        x, y = batches(inject=(1,))[1]
        fabric.backward(nn.functional.mse_loss(model(x).float(), y))
        assert not torch.isfinite(fabric.clip_gradients(model, opt, max_norm=1.0))  # no error: the step skips
        opt.step()
    assert plugin.scaler.state_dict()["skipped_steps"] == 1


def test_fabric_autocast_and_the_cast_policy_apply_in_the_fabric_loop():
    plugin = MixedPrecisionPlugin("bf16-mixed", policy={"fp32_modules": ["3"]})
    model = build()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = fabric.setup(model)
    seen = {}
    model.module[0].register_forward_hook(lambda m, i, o: seen.update(first=o.dtype))
    model.module[3].register_forward_hook(lambda m, i, o: seen.update(last=o.dtype))
    model(torch.randn(2, 16))
    assert seen == {"first": torch.bfloat16, "last": torch.float32}
    with fabric.autocast():
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.bfloat16


def test_an_optimizer_holding_parameters_outside_the_model_is_refused_at_setup():
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights=True)])
    with pytest.raises(ValueError, match="needs every optimizer parameter to belong to the model"):
        fabric.setup(build(), torch.optim.SGD(build().parameters(), lr=0.1))


def test_teardown_gives_the_model_its_fp32_values_and_the_strategy_its_methods():
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    fabric_loop(fabric, model, opt, batches()[:2])
    values = [v.clone() for v in model.state_dict().values()]
    fabric.strategy.teardown()
    assert not set(vars(fabric.strategy)) & {"optimizer_step", "setup_module", "save_checkpoint"}
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(values, model.state_dict().values()))


def test_audit_runs_on_a_fabric_wrapped_module_and_names_the_users_modules():
    from lightning_mp import audit

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = build()
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters()))
    x, y = batches()[0]
    for census in (audit(model, x), audit(model, lambda: nn.functional.mse_loss(model(x), y))):
        modules = {row.module for row in census.rows}
        assert "0" in modules and not any("_forward_module" in name for name in modules)
        assert census.half_flops_fraction() > 0.9  # Fabric's forward context ran: the matmuls are bf16
    assert all(p.grad is None for p in model.parameters())  # the audit's backward left nothing behind
    fabric.backward(nn.functional.mse_loss(model(x), y))  # and the loop goes on
    opt.step()


def test_a_scheduler_given_to_fabric_setup_does_not_advance_on_a_skipped_step():
    plugin = MixedPrecisionPlugin("bf16-mixed")
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, opt, scheduler = fabric.setup(model, opt, scheduler=scheduler)
    for x, y in batches(inject=(1, 2))[:5]:
        fabric.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert plugin.scaler.state_dict()["skipped_steps"] == 2
    assert scheduler.last_epoch == 3  # the 3 steps that ran


def test_a_second_model_with_master_weights_is_refused_and_the_plugin_pickles():
    import pickle

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=True)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = build()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy._fabric is None and plugin._fabric is not None
    with pytest.raises(ValueError, match="holds the masters of one model"):
        fabric.setup(build())
    without = MixedPrecisionPlugin("bf16-mixed")
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[without])
    first, second = fabric.setup(build()), fabric.setup(build())  # without masters: several models are fine
    fabric.backward(first(torch.randn(2, 16)).sum() + second(torch.randn(2, 16)).sum())
