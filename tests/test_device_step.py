"""The optimizer step without host synchronisation (lightning_mp.stepping): the found-inf flag, the skip and the
scaler's rules stay on the device; the host reads them lazily, and errors still fire at the step they are due.

Counts come from ``HostSyncCounter`` (tests/helpers.py), which counts every call that would make the host wait for
the device (``.item()``, ``bool(tensor)``, ``.tolist()``, ...) whatever device the tensor is on: on this CPU-only
machine it counts what would be a synchronisation on an accelerator. fp16 on CPU, tiny models.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin, stepping
from lightning_mp.master import MasterWeights
from lightning_mp.master.plain import PLAIN
from tests.helpers import HostSyncCounter, TinyRegressor, make_trainer, params_of, regression_loader, seeded


@pytest.fixture(autouse=True)
def accelerator_path(monkeypatch):
    """Run the path the plugin takes on accelerators on this CPU: by default a CPU flag is decided on the host (no
    device to wait for), which ``test_on_cpu_the_flag_is_read_on_the_host_by_default`` checks."""
    monkeypatch.setattr(stepping, "DECIDE_CPU_FLAGS_ON_HOST", False)


def _uncounted(closure):
    """Run the closure (forward, backward, Lightning's hooks) outside the sync counter."""
    from torch.overrides import _pop_mode_temporarily

    def run():
        with _pop_mode_temporarily():
            return closure()

    return run


@pytest.fixture
def step_syncs(monkeypatch):
    """Host syncs per call of the plugin's optimizer_step, the closure (forward and backward) left out."""
    counts: list[int] = []
    original = MixedPrecisionPlugin.optimizer_step

    def counted(self, optimizer, model, closure, **kwargs):
        counter = HostSyncCounter()
        try:
            with counter:
                return original(self, optimizer, model, _uncounted(closure), **kwargs)
        finally:  # a step that raises is counted too
            counts.append(len(counter.calls))

    monkeypatch.setattr(MixedPrecisionPlugin, "optimizer_step", counted)
    return counts


class ManualRegressor(TinyRegressor):
    """Manual optimization: one optimizer step every ``accumulate`` batches, gradients accumulated in between."""

    def __init__(self, accumulate: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.automatic_optimization = False
        self.accumulate = accumulate
        self.batches = 0

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y) / self.accumulate
        self.manual_backward(loss)
        if (batch_idx + 1) % self.accumulate == 0:
            if self.batches in self.inject_inf_at:  # with master weights the gradients are in the masters by now
                param = self.get_parameter(self.inject_param)
                masters = self.trainer.precision_plugin.masters
                master = masters.master_of(param) if masters is not None else None
                (master if master is not None else param).grad[0, 0] = float("inf")
            opt.step()
            opt.zero_grad()
            self.batches += 1
        return loss.detach()

    def on_after_backward(self):  # the injection happens before opt.step(), in training_step
        pass


def _scaler(kind: str):
    # fp16: a scale the tiny model's gradients fit under (2**16 would overflow them), growth within the run
    return {
        "fp16-dynamic": DynamicLossScaler(init_scale=1024.0, growth_interval=2),
        "fp16-static": 512.0,
        "bf16-check": None,
    }[kind]


def _precision(kind: str) -> str:
    return "bf16-mixed" if kind == "bf16-check" else "16-mixed"


def _run(
    kind: str,
    masters: bool,
    manual: bool,
    accumulate: int,
    inject=(1,),
    steps: int = 4,
    fused: bool = True,
    observer: bool = False,
    optimizer: str = "adam",
):
    with seeded():
        kwargs = dict(optimizer=optimizer, fused=fused, record_grad_norms=False, inject_inf_at=inject, lr=1e-2)
        model = ManualRegressor(accumulate=accumulate, **kwargs) if manual else TinyRegressor(**kwargs)
    plugin = MixedPrecisionPlugin(_precision(kind), scaler=_scaler(kind), master_weights=masters)
    if observer:  # a skip observer makes the plugin decide on the host (the reference for the device path)
        plugin.skip_observers.append(lambda **_: None)
    trainer_kwargs = dict(max_epochs=1, limit_train_batches=steps * accumulate)
    if not manual:
        trainer_kwargs["accumulate_grad_batches"] = accumulate
    trainer = make_trainer(plugin, **trainer_kwargs)
    trainer.fit(model, regression_loader())
    return model, plugin


MATRIX = [
    pytest.param(
        kind,
        masters,
        manual,
        accumulate,
        id=f"{kind}-{'masters' if masters else 'fp32'}-{'manual' if manual else 'auto'}-acc{accumulate}",
    )
    for kind in ("fp16-dynamic", "fp16-static", "bf16-check")
    for masters in (False, True)
    for manual in (False, True)
    for accumulate in (1, 2)
]


@pytest.mark.parametrize("kind, masters, manual, accumulate", MATRIX)
def test_no_host_sync_in_the_step_and_the_device_skip_equals_the_host_skip(
    kind, masters, manual, accumulate, step_syncs
):
    model, plugin = _run(kind, masters, manual, accumulate)
    assert step_syncs == [0, 0, 0, 0]  # 4 optimizer steps, a non-finite one among them, not one host sync
    assert plugin.scaler.pending_updates == 4  # nothing read the state yet
    step_syncs.clear()
    reference, reference_plugin = _run(kind, masters, manual, accumulate, observer=True)
    assert step_syncs == [1, 1, 1, 1]  # the reference decides on the host: one read per step
    # the same skipped step, the same scale, the same weights, bit for bit
    assert plugin.scaler.skipped_steps == reference_plugin.scaler.skipped_steps == 1
    assert plugin.scaler.state_dict() == reference_plugin.scaler.state_dict()
    for name, value in params_of(reference).items():
        assert torch.equal(params_of(model)[name], value), name


LEAN_MATRIX = [
    pytest.param(optimizer, manual, accumulate, id=f"{optimizer}-{'manual' if manual else 'auto'}-acc{accumulate}")
    for optimizer in ("adam", "rmsprop")
    for manual in (False, True)
    for accumulate in (1, 2)
]


@pytest.mark.parametrize("optimizer, manual, accumulate", LEAN_MATRIX)
def test_lean_masters_skip_on_the_device_in_both_paths(optimizer, manual, accumulate, step_syncs):
    # master_weights="remainder": Adam through torch's fused kernel, RMSprop through the generic chunked path, whose
    # first steps read the flag (the state is made, then the path learns that it can mask it: see
    # lightning_mp.master.lean.generic); then no step syncs, the non-finite one (step 2) included
    run = dict(kind="bf16-check", masters="remainder", manual=manual, accumulate=accumulate, inject=(2,), steps=4)
    model, plugin = _run(**run, optimizer=optimizer, fused=False)
    assert step_syncs == ([0, 0, 0, 0] if optimizer == "adam" else [1, 1, 0, 0])
    step_syncs.clear()
    reference, reference_plugin = _run(**run, optimizer=optimizer, fused=False, observer=True)
    assert step_syncs == [1, 1, 1, 1]
    assert plugin.scaler.skipped_steps == reference_plugin.scaler.skipped_steps == 1
    for name, value in params_of(reference).items():
        assert torch.equal(params_of(model)[name], value), name


def test_on_cpu_the_flag_is_read_on_the_host_by_default(step_syncs, monkeypatch):
    monkeypatch.setattr(stepping, "DECIDE_CPU_FLAGS_ON_HOST", True)
    model, plugin = _run("bf16-check", masters=False, manual=False, accumulate=1)
    assert step_syncs == [1, 1, 1, 1]  # a read of host memory: no device exists to wait for
    assert plugin.scaler.pending_updates == 0 and plugin.scaler.skipped_steps == 1
    monkeypatch.setattr(stepping, "DECIDE_CPU_FLAGS_ON_HOST", False)
    reference, _ = _run("bf16-check", masters=False, manual=False, accumulate=1)
    for name, value in params_of(reference).items():
        assert torch.equal(params_of(model)[name], value), name


def test_a_non_fused_optimizer_is_decided_on_the_host_once_per_step(step_syncs):
    # SGD: torch's for-loop Adam reads its own step counts on the host (.item()), which would be counted too
    _, plugin = _run("fp16-dynamic", masters=False, manual=False, accumulate=1, fused=False, optimizer="sgd")
    assert step_syncs == [1, 1, 1, 1]
    assert plugin.scaler.pending_updates == 0 and plugin.scaler.skipped_steps == 1


def test_a_step_interval_scheduler_reads_the_flag_at_the_step_and_holds_on_the_skipped_one(step_syncs):
    with seeded():
        model = TinyRegressor(
            optimizer="adam", fused=True, scheduler="step", inject_inf_at=[1], record_grad_norms=False
        )
    plugin = MixedPrecisionPlugin("bf16-mixed")
    make_trainer(plugin, max_steps=4).fit(model, regression_loader())
    assert step_syncs == [1, 1, 1, 1]
    assert model.lrs == [0.025, 0.025, 0.0125, 0.00625]  # step 1 was skipped: no advance after it
    step_syncs.clear()
    with seeded():
        model = TinyRegressor(optimizer="adam", fused=True, scheduler="epoch", record_grad_norms=False)
    make_trainer(MixedPrecisionPlugin("bf16-mixed"), max_steps=4).fit(model, regression_loader())
    assert step_syncs == [0, 0, 0, 0]  # an epoch-interval scheduler needs nothing at the step


def test_fp16_dynamic_reads_only_on_the_steps_where_an_error_may_be_due(step_syncs):
    # scale 2**4, min_scale 1, backoff 0.5, hysteresis 1: four backoffs are possible, the fifth non-finite step in a
    # row could raise, so the host decides step 5 after each read; max_consecutive_skips=3 caps it at 3 skips
    scaler = DynamicLossScaler(init_scale=16.0, growth_interval=1000, max_consecutive_skips=None)
    with seeded():
        model = TinyRegressor(optimizer="adam", fused=True, record_grad_norms=False)
    make_trainer(MixedPrecisionPlugin(scaler=scaler), max_steps=12).fit(model, regression_loader(n=96))
    assert step_syncs == [0, 0, 0, 0, 1] * 2 + [0, 0]
    assert scaler.steps == 12 and scaler.pending_updates == 2


def test_max_consecutive_skips_fires_at_the_step_it_is_due_naming_the_parameter(step_syncs):
    with seeded():
        model = TinyRegressor(
            optimizer="adam", fused=True, record_grad_norms=False, inject_inf_at=range(100), inject_param="net.2.weight"
        )
    plugin = MixedPrecisionPlugin("bf16-mixed", scaler={"max_consecutive_skips": 3})
    with pytest.raises(FloatingPointError, match=r"3 optimizer steps in a row.*net\.2\.weight"):
        make_trainer(plugin, max_steps=10).fit(model, regression_loader())
    # raised at the third step, as the host rules do, not one step late: one read, then the culprits' names
    assert len(step_syncs) == 3 and step_syncs[:2] == [0, 0] and step_syncs[2] >= 1
    assert plugin.scaler.steps == 3 and plugin.scaler.skipped_steps == 3


def test_min_scale_fires_at_the_step_it_is_due_naming_the_parameter(step_syncs):
    # scale 8, min 1, hysteresis 2: steps 0-1 use the allowance and back off (8 -> 4), 2 and 3 back off to 1,
    # the fifth non-finite step would go below min_scale
    scaler = DynamicLossScaler(init_scale=8.0, hysteresis=2, max_consecutive_skips=None)
    with seeded():
        model = TinyRegressor(
            optimizer="adam", fused=True, record_grad_norms=False, inject_inf_at=range(100), inject_param="net.0.weight"
        )
    with pytest.raises(FloatingPointError, match=r"min_scale=1.*net\.0\.weight"):
        make_trainer(MixedPrecisionPlugin(scaler=scaler), max_steps=10).fit(model, regression_loader())
    assert len(step_syncs) == 5 and step_syncs[:4] == [0, 0, 0, 0] and step_syncs[4] >= 1
    assert scaler.steps == 5 and scaler.scale == 1.0


class LeanMasters(MasterWeights):
    """A stand-in for masters that update themselves (``updates_itself``: the step hands them the flag, as to lean
    masters): here the fp32 masters stepped by the optimizer's fused kernel with the flag, then copied into the
    model."""

    updates_itself = True

    def __init__(self, dtype):
        super().__init__(dtype)
        self.flags: list = []

    def step(self, optimizer, found_inf, run):
        self.flags.append(found_inf)
        optimizer.grad_scale, optimizer.found_inf = None, found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
        self.masters_to_model(optimizer)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_masters_that_update_themselves_get_the_device_flag_instead_of_optimizer_step(precision, step_syncs):
    results = []
    for lean in (False, True):
        with seeded():
            model = TinyRegressor(optimizer="adam", fused=True, record_grad_norms=False, inject_inf_at=[2])
        scaler = DynamicLossScaler(init_scale=1024.0) if precision == "16-mixed" else None
        plugin = MixedPrecisionPlugin(precision, scaler=scaler, master_weights=True)
        if lean:
            plugin.masters = LeanMasters(plugin.dtype)
            plugin.masters.keep_fp32 = plugin.params_stay_fp32
        make_trainer(plugin, max_steps=4).fit(model, regression_loader())
        results.append(params_of(model))
    assert [float(flag) for flag in plugin.masters.flags] == [0.0, 0.0, 1.0, 0.0]
    assert all(flag.shape == () and flag.dtype == torch.float32 for flag in plugin.masters.flags)
    assert step_syncs == [0] * 8
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def test_masters_that_update_themselves_are_called_with_none_when_nothing_is_checked():
    with seeded():
        model = TinyRegressor(optimizer="adam", fused=True, record_grad_norms=False)
    plugin = MixedPrecisionPlugin("bf16-mixed", scaler={"enabled": False}, master_weights=True)
    plugin.masters = LeanMasters(plugin.dtype)
    make_trainer(plugin, max_steps=2).fit(model, regression_loader())
    assert plugin.masters.flags == [None, None]


def test_which_optimizers_skip_on_the_device():
    params = [nn.Parameter(torch.zeros(2))]
    assert PLAIN.skips_on_device(torch.optim.AdamW(params, fused=True))
    assert PLAIN.skips_on_device(torch.optim.SGD(params, lr=0.1, fused=True))
    assert not PLAIN.skips_on_device(torch.optim.AdamW(params))  # for-loop / foreach: decided on the host
    assert not PLAIN.skips_on_device(torch.optim.AdamW(params, foreach=True))

    class OldProtocol(torch.optim.SGD):  # expects torch's GradScaler through `grad_scaler=`: never given ours
        _step_supports_amp_scaling = True

        def step(self, closure=None, grad_scaler=None):
            return super().step(closure)

    assert not PLAIN.skips_on_device(OldProtocol(params, lr=0.1))
    assert LeanMasters(torch.bfloat16).skips_on_device(torch.optim.AdamW(params))
