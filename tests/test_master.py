"""fp32 master weights: the half model trains like fp32, and small updates are not lost."""

from functools import partial

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from lightning_mp.master import MasterWeights
from tests.helpers import TinyRegressor, make_trainer, params_of, regression_loader, seeded

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICE_PRECISIONS = [
    pytest.param("cpu", "16-mixed", id="cpu-fp16"),
    pytest.param("cpu", "bf16-mixed", id="cpu-bf16"),
    pytest.param("cuda", "16-mixed", id="cuda-fp16", marks=[pytest.mark.gpu, CUDA]),
    pytest.param("cuda", "bf16-mixed", id="cuda-bf16", marks=[pytest.mark.gpu, CUDA]),
]


def _plugin(precision="16-mixed", init_scale=1024.0, **kwargs):
    scaler = DynamicLossScaler(init_scale=init_scale) if precision == "16-mixed" else None
    return MixedPrecisionPlugin(precision, scaler=scaler, master_weights=True, **kwargs)


# ---------------------------------------------------------------------- the reason masters exist
class ScalarWeight(L.LightningModule):
    """loss = w * x with w = 1.0 and x = 1: each SGD step moves w by lr, here 1e-4, below fp16's spacing at 1.0
    (2**-10), so a step applied in fp16 rounds back to 1.0."""

    def __init__(self, lr=1e-4, accumulate_probe=False):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.lr = lr
        self.half_values = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.w * x).sum().float()

    def on_train_batch_end(self, *args):
        self.half_values.append(self.w.detach().clone())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _ones_loader(steps, values=(1.0,)):
    x = torch.tensor(list(values) * steps).reshape(-1, 1)
    return DataLoader(TensorDataset(x), batch_size=1)


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])])
def test_updates_below_half_resolution_are_kept_by_masters(accelerator):
    steps = 100
    expected = 1.0 - steps * 1e-4  # fp32 SGD: 0.99

    half_model = ScalarWeight()
    L.Trainer(
        accelerator=accelerator,
        precision="16-true",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(half_model, _ones_loader(steps))
    assert half_model.w.item() == 1.0  # every update was rounded away

    fp32_model = ScalarWeight()
    make_trainer(None, accelerator=accelerator).fit(fp32_model, _ones_loader(steps))
    assert fp32_model.w.item() == pytest.approx(expected, abs=100 * 2.0**-24)  # fp32 rounding of 100 steps

    ours = ScalarWeight()
    make_trainer(_plugin(), accelerator=accelerator).fit(ours, _ones_loader(steps))
    assert ours.w.dtype == torch.float32  # after fit the model holds the masters
    # the gradient (x = 1) is exact in fp16, so the masters take exactly the fp32 steps
    assert ours.w.item() == fp32_model.w.item()
    # during training the half copy followed the master, within fp16's rounding of the final copy
    assert ours.half_values[-1].dtype == torch.float16
    assert abs(ours.half_values[-1].item() - expected) <= 2.0**-11


# ---------------------------------------------------------------------- close to fp32, far closer than 16-true
class SmallMLP(L.LightningModule):
    def __init__(self, optimizer="sgd", lr=1e-3):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 1))
        self.optimizer_name, self.lr = optimizer, lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def _mlp_loader():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 16, generator=gen)
    y = torch.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    return DataLoader(TensorDataset(x, y), batch_size=16)


def _train_mlp(optimizer, lr, plugin=None, precision=None):
    with seeded(5):
        model = SmallMLP(optimizer, lr)
    kwargs = dict(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    if plugin is not None:
        kwargs["plugins"] = [plugin]
    if precision is not None:
        kwargs["precision"] = precision
    L.Trainer(**kwargs).fit(model, _mlp_loader())
    return {k: v.float() for k, v in params_of(model).items()}, model


def _max_error(params, reference):
    """Largest absolute difference; inf when the run diverged (16-true AdamW does: eps=1e-8 is 0 in fp16)."""
    errors = [(params[k] - reference[k]).abs().max().item() for k in reference]
    return max(e if e == e else float("inf") for e in errors)


@pytest.mark.parametrize("optimizer, lr", [("sgd", 1e-3), ("adamw", 1e-4)])
def test_masters_track_fp32_far_closer_than_16_true(optimizer, lr):
    reference, _ = _train_mlp(optimizer, lr)
    ours, _ = _train_mlp(optimizer, lr, plugin=_plugin())
    half, _ = _train_mlp(optimizer, lr, precision="16-true")
    with seeded(5):
        initial = {k: v.detach() for k, v in SmallMLP(optimizer, lr).named_parameters()}
    movement = _max_error(reference, initial)  # how far fp32 training moved the weights in 16 steps
    # The masters differ from fp32 only by the error of the fp16 forward/backward: gradients with a relative
    # error of a few 2**-11 (~1e-3). Summed over the 16 steps that is at most ~1e-3 of the distance the
    # weights moved; we allow 1%.
    assert _max_error(ours, reference) <= 1e-2 * movement
    # 16-true rounds every update into fp16 and loses most of them
    assert _max_error(half, reference) >= 10 * _max_error(ours, reference)


# ---------------------------------------------------------------------- step mechanics
class Recorder(L.Callback):
    def __init__(self):
        self.model_before, self.model_after, self.masters_after, self.half_grads = [], [], [], []

    def on_train_batch_start(self, trainer, module, *args):
        self.model_before.append(params_of(module))

    def on_before_optimizer_step(self, trainer, module, optimizer):
        masters = trainer.precision_plugin.masters
        # the model shows its masters' fp32 gradients: equal now (references kept across steps would not be)
        self.half_grads.append(
            [
                p.grad.dtype == torch.float32 and torch.equal(p.grad, masters.master_of(p).grad)
                for p in module.parameters()
            ]
        )

    def on_train_batch_end(self, trainer, module, *args):
        self.model_after.append(params_of(module))
        self.masters_after.append([m.detach().clone() for g in trainer.optimizers[0].param_groups for m in g["params"]])
        masters = trainer.precision_plugin.masters
        for p in module.parameters():  # the master's fp32 gradient shown, or none: no half gradient left behind
            master = masters.master_of(p)
            assert p.grad is None if master.grad is None else p.grad.data_ptr() == master.grad.data_ptr()


def test_overflow_skips_step_leaves_masters_and_model_unchanged_and_holds_scheduler():
    recorder = Recorder()
    with seeded():
        model = TinyRegressor(scheduler="step", inject_inf_at=[3], record_grad_norms=False)
    plugin = _plugin()
    make_trainer(plugin, callbacks=[recorder]).fit(model, regression_loader())
    assert plugin.scaler.skipped_steps == 1 and plugin.scaler.scale == 512.0
    for name in recorder.model_before[3]:
        assert torch.equal(recorder.model_before[3][name], recorder.model_after[3][name])
        assert not torch.equal(recorder.model_before[4][name], recorder.model_after[4][name])
    for before, after in zip(recorder.masters_after[2], recorder.masters_after[3]):
        assert torch.equal(before, after)
    assert model.lrs == pytest.approx([0.05 * 0.5 ** (i + 1 - (i >= 3)) for i in range(8)], rel=1e-12)
    # the half gradients were moved to the masters before Lightning's hooks ran; the model shows the masters' ones
    assert all(all(shown) for shown in recorder.half_grads)


def test_accumulation_happens_in_fp32():
    """Two micro-batches with inputs 1 and 2**-12; Lightning divides each loss by 2, so the gradients are 0.5 and
    2**-13. fp16 cannot hold their sum (its spacing at 0.5 is 2**-11, so the sum rounds to 0.5); fp32 can."""

    class Probe(ScalarWeight):
        def on_before_optimizer_step(self, optimizer):
            self.master_grad = optimizer.param_groups[0]["params"][0].grad.clone()

    model = Probe()
    plugin = MixedPrecisionPlugin(scaler=1.0, master_weights=True)  # static scale 1: the grads are the values
    make_trainer(plugin, accumulate_grad_batches=2, max_steps=1).fit(model, _ones_loader(1, values=(1.0, 2.0**-12)))
    assert model.master_grad.dtype == torch.float32
    assert model.master_grad.item() == 0.5 + 2.0**-13


@pytest.mark.parametrize("algorithm, clip_val", [("norm", 1e-3), ("value", 1e-4)])
def test_clipping_acts_on_the_masters_unscaled_grads(algorithm, clip_val):
    with seeded():
        model = TinyRegressor(lr=1.0, record_grad_norms=False)
    start = params_of(model)
    trainer = make_trainer(_plugin(), max_steps=1, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)
    trainer.fit(model, regression_loader())
    deltas = [start[k] - v for k, v in params_of(model).items()]  # fp32 masters after fit
    if algorithm == "norm":
        assert torch.linalg.vector_norm(torch.stack([d.norm() for d in deltas])).item() == pytest.approx(
            clip_val, rel=1e-4
        )
    else:
        assert max(d.abs().max().item() for d in deltas) == pytest.approx(clip_val, rel=1e-4)


class TwoGroups(TinyRegressor):
    def configure_optimizers(self):
        return torch.optim.SGD(
            [
                {"params": self.net[0].parameters(), "lr": 0.1, "weight_decay": 0.01},
                {"params": self.net[2].parameters(), "lr": 0.001, "momentum": 0.5},
            ],
            lr=0.05,
        )


@pytest.mark.parametrize("precision, relative_error", [("16-mixed", 1e-3), ("bf16-mixed", 1e-2)])
def test_param_groups_keep_their_options_and_train_like_fp32(precision, relative_error):
    results = {}
    for name, plugin in [("fp32", None), ("ours", _plugin(precision))]:
        with seeded():
            model = TwoGroups(record_grad_norms=False)
        start = params_of(model)
        trainer = make_trainer(plugin, max_steps=4)
        trainer.fit(model, regression_loader())
        results[name] = params_of(model)
        groups = trainer.optimizers[0].param_groups
        assert [(g["lr"], g["weight_decay"], g["momentum"]) for g in groups] == [(0.1, 0.01, 0), (0.001, 0, 0.5)]
    movement = _max_error(results["fp32"], start)
    # SGD: the masters differ from fp32 by lr times the gradient error of the half forward/backward, a few
    # roundings of 2**-11 (fp16) or 2**-8 (bf16): ~1e-3 / ~1e-2 of the distance travelled
    assert _max_error(results["ours"], results["fp32"]) <= relative_error * movement


@pytest.mark.parametrize("keep_norm_fp32", [True, False])
def test_norm_layers_stay_fp32_unless_told_otherwise(keep_norm_fp32):
    class WithNorms(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(1, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.ln = nn.LayerNorm(4)
            self.head = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            self.seen = {n: p.dtype for n, p in self.named_parameters()} | {n: b.dtype for n, b in self.named_buffers()}
            x, y = batch
            h = self.bn(self.conv(x)).mean(dim=(2, 3))
            return nn.functional.mse_loss(self.head(self.ln(h)).float(), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    loader = DataLoader(TensorDataset(torch.randn(8, 1, 6, 6), torch.randn(8, 1)), batch_size=4)
    model = WithNorms()
    make_trainer(_plugin("bf16-mixed", keep_norm_fp32=keep_norm_fp32), max_steps=2).fit(model, loader)
    norm_dtype = torch.float32 if keep_norm_fp32 else torch.bfloat16
    for name, dtype in model.seen.items():
        if name == "bn.num_batches_tracked":
            assert dtype == torch.long
        elif name.startswith(("bn.", "ln.")):
            assert dtype == norm_dtype, name
        else:
            assert dtype == torch.bfloat16, name


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_holds_fp32_masters_and_loads_into_a_plain_fp32_model(tmp_path):
    class SaveMidway(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 4:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")
                trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
                self.masters = {
                    name: trainer.precision_plugin.masters.master_of(p).detach().clone()
                    for name, p in module.named_parameters()
                }
                self.half = {name: p.detach().clone() for name, p in module.named_parameters()}

    saver = SaveMidway()
    with seeded():
        model = TinyRegressor(optimizer="adam", lr=1e-2, record_grad_norms=False)
    make_trainer(_plugin(), callbacks=[saver]).fit(model, regression_loader())
    for file in ("mid.ckpt", "weights.ckpt"):
        state = torch.load(tmp_path / file, weights_only=False)["state_dict"]
        plain = TinyRegressor()
        plain.load_state_dict(state, strict=True)
        for name, param in plain.named_parameters():
            assert state[name].dtype == torch.float32
            assert torch.equal(param, saver.masters[name]), name
            assert not torch.equal(param, saver.half[name].float()), "the checkpoint must not hold the fp16 copy"


def test_resume_reproduces_uninterrupted_run_bit_exactly(tmp_path):
    def settings():
        kwargs = dict(optimizer="adam", lr=1e-2, scheduler="step", gamma=0.95, inject_inf_at=[5, 13, 14])
        return kwargs, MixedPrecisionPlugin(
            scaler=DynamicLossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2), master_weights=True
        )

    kwargs, plugin = settings()
    with seeded(0):
        full = TinyRegressor(**kwargs)
    full_trainer = make_trainer(plugin, max_epochs=4)
    full_trainer.fit(full, regression_loader())

    kwargs, plugin = settings()
    with seeded(0):
        first = TinyRegressor(**kwargs)
    first_trainer = make_trainer(plugin, max_epochs=2)
    first_trainer.fit(first, regression_loader())
    first_trainer.save_checkpoint(tmp_path / "half.ckpt")

    kwargs, plugin = settings()
    with seeded(1):
        resumed = TinyRegressor(**kwargs)
    resumed_trainer = make_trainer(plugin, max_epochs=4)
    resumed_trainer.fit(resumed, regression_loader(), ckpt_path=tmp_path / "half.ckpt")

    assert full_trainer.scaler.skipped_steps >= 2
    assert resumed_trainer.scaler.state_dict() == full_trainer.scaler.state_dict()
    for name, param in full.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(resumed.get_parameter(name), param), name
    full_state = full_trainer.optimizers[0].state_dict()["state"]
    resumed_state = resumed_trainer.optimizers[0].state_dict()["state"]
    for key in full_state:
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(resumed_state[key][field], full_state[key][field])


# ---------------------------------------------------------------------- evaluation and after training
def test_validation_runs_the_half_model_and_validate_alone_is_lossless():
    class Evaluated(TinyRegressor):
        def validation_step(self, batch, batch_idx):
            self.val_dtypes = {p.dtype for p in self.parameters()}
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x).float(), y))

    with seeded():
        model = Evaluated(record_grad_norms=False)
    before = params_of(model)
    make_trainer(_plugin()).validate(model, regression_loader())
    assert model.val_dtypes == {torch.float16}
    for name, param in model.named_parameters():  # validate() alone gives the exact fp32 weights back
        assert param.dtype == torch.float32 and torch.equal(param, before[name])

    trainer = make_trainer(_plugin(), max_epochs=1)
    model.val_dtypes = None
    trainer.fit(model, regression_loader(), regression_loader())
    assert model.val_dtypes == {torch.float16}


def test_after_fit_the_model_holds_the_masters_and_the_optimizer_the_model_params():
    class Snapshot(L.Callback):
        def on_train_end(self, trainer, module):
            self.masters = {
                n: trainer.precision_plugin.masters.master_of(p).detach().clone() for n, p in module.named_parameters()
            }

    snapshot = Snapshot()
    with seeded():
        model = TinyRegressor(optimizer="adam", record_grad_norms=False)
    trainer = make_trainer(_plugin(), callbacks=[snapshot])
    trainer.fit(model, regression_loader())
    model.to(torch.float32)
    for name, param in model.named_parameters():
        assert torch.equal(param, snapshot.masters[name])
    optimizer = trainer.optimizers[0]
    assert [id(p) for g in optimizer.param_groups for p in g["params"]] == [id(p) for p in model.parameters()]
    assert all(p in optimizer.state for p in model.parameters())


# ---------------------------------------------------------------------- memory
def test_bytes_per_parameter_with_adam():
    class Mixed(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(32, 64)
            self.norm = nn.LayerNorm(64)
            self.head = nn.Linear(64, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.head(self.norm(self.body(x))).float(), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    class Count(L.Callback):
        def on_train_batch_end(self, trainer, module, *args):
            plugin, optimizer = trainer.precision_plugin, trainer.optimizers[0]
            seen, total = set(), 0

            def add(tensor):
                nonlocal total
                if tensor is None:
                    return
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()

            for p in module.parameters():
                add(p)
                add(p.grad)
            for flat, flat_grad in plugin.masters.flat_buffers:
                add(flat)
                add(flat_grad)
            for group in optimizer.param_groups:
                for p in group["params"]:
                    add(p)
                    add(p.grad)
                    for key, value in optimizer.state[p].items():
                        if key != "step":  # Adam's step counter, one scalar per tensor
                            add(value)
            self.total = total

    loader = DataLoader(TensorDataset(torch.randn(8, 32), torch.randn(8, 1)), batch_size=4)
    counter = Count()
    model = Mixed()
    half = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("norm."))
    full = sum(p.numel() for n, p in model.named_parameters() if n.startswith("norm."))
    # zero_grad_after_step=False: the gradients counted after the step, as they are alive during it
    make_trainer(_plugin(zero_grad_after_step=False), max_steps=1, callbacks=[counter]).fit(model, loader)
    # half params: 2 (fp16 weight) + 4 (master) + 4 (master grad) + 8 (Adam moments) = 18 bytes
    # norm params kept fp32: 4 (weight) + 4 (grad) + 8 (Adam moments) = 16 bytes; no half grad survives
    assert counter.total == 18 * half + 16 * full


# ---------------------------------------------------------------------- bad input
def test_optimizer_with_a_parameter_outside_the_model_is_refused():
    class Stray(TinyRegressor):
        def configure_optimizers(self):
            self.outsider = torch.ones(3, requires_grad=True)
            return torch.optim.SGD([*self.parameters(), self.outsider], lr=0.1)

    with seeded():
        model = Stray()
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[4\] \(shape \(3,\)"):
        make_trainer(_plugin()).fit(model, regression_loader())


def test_master_weights_argument_must_be_bool():
    with pytest.raises(ValueError, match="master_weights='yes'"):
        MixedPrecisionPlugin(master_weights="yes")


def test_master_weights_without_a_trainer():
    """MasterWeights is usable in a plain loop: convert, attach, step, copy back, restore."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    reference = [p.detach().clone() for p in model.parameters()]
    masters = MasterWeights(torch.bfloat16)
    masters.convert(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    masters.attach([optimizer])
    assert model[0].weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.float32
    assert optimizer.param_groups[0]["params"][0].dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.randn(8, 4)).float().pow(2).mean()
    loss.backward()
    masters.grads_to_masters()
    optimizer.step()
    masters.masters_to_model(optimizer)
    masters.restore()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    moved = [not torch.equal(p, r) for p, r in zip(model.parameters(), reference)]
    assert all(moved)  # 1e-4 updates survive in the masters; bf16 would have rounded most of them away


def test_a_model_that_arrives_in_half_precision_still_trains_fp32_masters():
    class Probe(ScalarWeight):
        def on_before_optimizer_step(self, optimizer):
            self.optimizer_dtype = optimizer.param_groups[0]["params"][0].dtype

    model = Probe().half()
    make_trainer(_plugin(), max_steps=100).fit(model, _ones_loader(100))
    assert model.optimizer_dtype == torch.float32
    assert model.w.dtype == torch.float32 and model.w.item() == pytest.approx(0.99, abs=100 * 2.0**-24)


class _TiedLM(L.LightningModule):
    """Embedding -> Linear(16, 16) -> head, the head's weight tied to the embedding's (GPT-2's lm_head / wte)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 12, bias=False)
        self.head.weight = self.embed.weight
        self.seen: dict[str, torch.dtype] = {}
        for name in ("embed", "body", "head"):
            getattr(self, name).register_forward_pre_hook(partial(self._note_dtype, name))

    def _note_dtype(self, name, module, args) -> None:
        self.seen.setdefault(name, module.weight.dtype)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.head(torch.tanh(self.body(self.embed(ids))))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("rule", ["head", "Linear"])  # by name, and the class rule that matches any tied Linear
def test_a_tied_parameter_stays_fp32_under_every_name_when_a_module_holding_it_is_kept_fp32(rule):
    ids = torch.randint(0, 12, (8, 6), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(ids), batch_size=4)
    with seeded(0):
        reference = _TiedLM()
    make_trainer(max_steps=2).fit(reference, loader)  # fp32
    with seeded(0):
        model = _TiedLM()
    plugin = MixedPrecisionPlugin(
        "16-mixed", master_weights=True, policy={"fp32_modules": [rule]}, scaler=DynamicLossScaler(init_scale=256.0)
    )
    make_trainer(plugin, max_steps=2).fit(model, loader)
    assert model.head.weight is model.embed.weight
    # while training: the tied weight fp32 in both of its modules, the untied Linear half unless the rule takes it
    assert model.seen["head"] == model.seen["embed"] == torch.float32
    assert model.seen["body"] == (torch.float32 if rule == "Linear" else torch.float16)
    assert plugin.masters.master_of(model.embed.weight) is None  # an fp32 parameter is trained as it is
    assert plugin.scaler.skipped_steps == 0
    torch.testing.assert_close(model.embed.weight, reference.embed.weight, rtol=0, atol=1e-3)


@pytest.mark.parametrize("masters", [True, "remainder"])
@pytest.mark.parametrize("rule", ["block", "blo*"])  # a name and a glob on the parent
def test_a_module_inside_an_fp32_module_keeps_fp32_parameters(masters, rule):
    """The policy runs an fp32 module's whole subtree in fp32 (autocast off, inputs upcast), so the layers inside it
    keep fp32 parameters too; before, an fp16 Linear inside met fp32 inputs: "expected m1 and m2 to have the same
    dtype"."""
    precision = "16-mixed" if masters is True else "bf16-mixed"
    with seeded(0):
        model = TinyRegressor()
        model.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model.forward = lambda x: model.net(model.block(x))  # type: ignore[method-assign]
    seen: dict[str, torch.dtype] = {}  # while training (after fit the model holds the masters again)
    for name in ("block.0", "block.2", "net.0"):
        layer = model.get_submodule(name)
        layer.register_forward_pre_hook(lambda mod, args, name=name: seen.setdefault(name, mod.weight.dtype) and None)
    plugin = MixedPrecisionPlugin(precision, master_weights=masters, policy={"fp32_modules": [rule]})
    make_trainer(plugin, max_steps=2).fit(model, regression_loader())
    assert seen == {"block.0": torch.float32, "block.2": torch.float32, "net.0": plugin.dtype}
