"""``optimizer_in_backward=True``: the lean update of each parameter inside backward, its gradient freed.

The reference of every run is the normal lean step (``optimizer_in_backward=False``) on the same model, data and
seed: the fp32 weights a checkpoint holds and the optimizer state must be the same bits.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

OPTIMIZERS = ("adamw", "adam", "sgd")
#: CUDA runs the Triton kernel per parameter and checks bf16 gradients by their inf-norm: the same tests there
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
    ),
]


class Net(L.LightningModule):
    """Linear (bf16 + remainder: bf16 gradients) -> LayerNorm (kept fp32: fp32 gradients) -> GELU -> Linear."""

    def __init__(
        self, optimizer: str = "adamw", bad_loss_at: int = -1, bad_grad_at: int = -1, scheduler: bool = False
    ) -> None:
        super().__init__()
        self.scheduler, self.lrs = scheduler, []
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
        self.optimizer_name, self.bad_loss_at, self.bad_grad_at = optimizer, bad_loss_at, bad_grad_at
        self.grads_after_step: list[list[Optional[torch.Tensor]]] = []
        self.skipped_params: list[list[str]] = []
        if bad_grad_at >= 0:  # an inf in net.3.weight's gradient, as soon as autograd has produced it
            self.net[3].weight.register_hook(lambda g: self._poison(g))

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step == self.bad_grad_at:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        return loss * float("nan") if self.trainer.global_step == self.bad_loss_at else loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.training_step(batch, batch_idx)

    def on_train_batch_end(self, *args: Any) -> None:
        self.grads_after_step.append([p.grad for p in self.parameters()])
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        in_backward = self.trainer.precision_plugin.steps.in_backward
        if in_backward is not None:  # read when asked: a host read on the device path
            self.skipped_params.append(in_backward.skipped_params)

    def configure_optimizers(self) -> Any:
        if self.scheduler:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=1e-2, weight_decay=0.01, amsgrad=True)
        return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)


def _loader(n: int = 48) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(
    in_backward: bool, tmp_path: Path, name: str, optimizer: str = "adamw", resume: Optional[Path] = None, **kw: Any
) -> tuple[Net, dict[str, Any]]:
    """Fit a fresh seeded :class:`Net` (``kw``: its arguments and the Trainer's); the checkpoint written at the end."""
    model_kw = {k: kw.pop(k) for k in ("bad_loss_at", "bad_grad_at", "scheduler") if k in kw}
    with seeded():
        model = Net(optimizer, **model_kw)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    trainer = make_trainer(plugin, **kw)
    trainer.fit(model, _loader(), ckpt_path=resume)
    path = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(path)
    return model, torch.load(path, weights_only=True)


def _device_path(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """``path="device"``: CPU flags left on the device, as an accelerator's are (the step's rule, for the step inside
    backward and the normal step alike); ``"host"``: the default, CPU flags read after backward."""
    from lightning_mp import stepping

    monkeypatch.setattr(stepping, "DECIDE_CPU_FLAGS_ON_HOST", path == "host")


def _assert_same_bits(ours: dict[str, Any], reference: dict[str, Any]) -> None:
    assert ours["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert value.dtype == torch.float32 and torch.equal(ours["state_dict"][key], value), key
    states, reference_states = ours["optimizer_states"][0]["state"], reference["optimizer_states"][0]["state"]
    assert states.keys() == reference_states.keys() and states
    for index, state in reference_states.items():
        assert states[index].keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(states[index][key], value), (index, key)
    assert ours["global_step"] == reference["global_step"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_updates_in_backward_equal_the_normal_lean_step_bitwise_and_free_the_gradients(tmp_path, optimizer, device):
    model, ours = _fit(True, tmp_path, "ours", optimizer, max_steps=4, accelerator=device)
    _, reference = _fit(False, tmp_path, "reference", optimizer, max_steps=4, accelerator=device)
    _assert_same_bits(ours, reference)
    assert ours["global_step"] == 4
    # both gradient dtypes were updated: bf16 (lean Linear) and fp32 (the LayerNorm kept fp32)
    assert model.net[0].weight.dtype == torch.float32  # teardown gave back the fp32 values
    # freed as soon as used, all but the smallest parameter's: the probe of what zero_grad does (in_backward_zero_grads)
    params = list(model.parameters())
    probe = min(params, key=torch.Tensor.numel)
    for step in model.grads_after_step:
        assert [p for p, grad in zip(params, step) if grad is not None] == [probe]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_chunked_fallback_without_the_kernel_is_bitwise_too(tmp_path, monkeypatch, optimizer):
    monkeypatch.setenv("LIGHTNING_MP_NATIVE", "0")  # no one-pass kernel: torch's fused kernel on joined chunks
    model, ours = _fit(True, tmp_path, "ours", optimizer, max_steps=3)
    _, reference = _fit(False, tmp_path, "reference", optimizer, max_steps=3)
    _assert_same_bits(ours, reference)
    probe = min(model.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
    assert all(
        grad is None for step in model.grads_after_step for p, grad in zip(model.parameters(), step) if p is not probe
    )


def test_clip_by_value_runs_per_parameter_inside_backward_bitwise(tmp_path):
    clip = dict(gradient_clip_val=0.05, gradient_clip_algorithm="value", max_steps=4)
    _, ours = _fit(True, tmp_path, "ours", **clip)
    _, reference = _fit(False, tmp_path, "reference", **clip)
    _assert_same_bits(ours, reference)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_loss_skips_every_update_of_its_step(tmp_path, monkeypatch, device, path):
    # step 2's loss is NaN: after 3 steps the state equals the normal lean step's after the same 3 steps, where
    # the check skips step 2 as a whole (all its gradients are NaN). device: the flags are not read at the step
    _device_path(monkeypatch, path)
    _, ours = _fit(True, tmp_path, "ours", bad_loss_at=2, max_steps=3, accelerator=device)
    _, two = _fit(True, tmp_path, "two", max_steps=2, accelerator=device)
    for key, value in two["state_dict"].items():
        assert torch.equal(ours["state_dict"][key], value), key
    for index, state in two["optimizer_states"][0]["state"].items():
        for key, value in state.items():
            assert torch.equal(ours["optimizer_states"][0]["state"][index][key], value), (index, key)
    _, reference = _fit(False, tmp_path, "reference", bad_loss_at=2, max_steps=3, accelerator=device)
    _assert_same_bits(ours, reference)


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_step_scheduler_advances_as_with_the_normal_step_and_holds_on_a_non_finite_loss(tmp_path, monkeypatch, path):
    # on the device path too the flags are read at the step: the scheduler needs the decision there
    _device_path(monkeypatch, path)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*lr_scheduler.step\\(\\)")  # torch's "before optimizer.step()"
        ours_model, ours = _fit(True, tmp_path, "ours", bad_loss_at=2, scheduler=True, max_steps=5)
    reference_model, reference = _fit(False, tmp_path, "reference", bad_loss_at=2, scheduler=True, max_steps=5)
    assert ours_model.lrs == reference_model.lrs and ours_model.lrs[1] == ours_model.lrs[2]  # held on step 2
    _assert_same_bits(ours, reference)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_gradient_skips_that_parameter_only_and_is_reported(tmp_path, monkeypatch, device, path):
    # host: the flags are read after backward (CPU flags by default; a skip observer or a step scheduler anywhere),
    # with a warning naming the parameter. device (an accelerator's path, run here on CPU flags too): nothing is
    # read at the step, the scaler counts the skip on the device, the name is read only when asked
    _device_path(monkeypatch, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, ours = _fit(True, tmp_path, "ours", bad_grad_at=1, max_steps=2, accelerator=device)
    reported = [w for w in caught if "non-finite gradients in 1 parameter(s) (net.3.weight)" in str(w.message)]
    assert len(reported) == (path == "host" and device == "cpu")  # CUDA flags: read for an observer or scheduler only
    assert model.skipped_params == [[], ["net.3.weight"]]
    assert model.trainer.precision_plugin.scaler.skipped_steps == 1  # counted either way
    _, one = _fit(True, tmp_path, "one", max_steps=1, accelerator=device)
    _, two = _fit(True, tmp_path, "two", max_steps=2, accelerator=device)
    index = list(dict(Net().named_parameters())).index("net.3.weight")
    for key, value in ours["state_dict"].items():
        expected = one if key == "net.3.weight" else two  # that parameter as after step 1, the others stepped
        assert torch.equal(value, expected["state_dict"][key]), key
    for i, state in ours["optimizer_states"][0]["state"].items():
        expected = one if i == index else two
        for key, value in state.items():
            assert torch.equal(value, expected["optimizer_states"][0]["state"][i][key]), (i, key)


@pytest.mark.parametrize(("first", "then"), [(True, False), (False, True), (True, True)])
def test_checkpoints_move_between_in_backward_and_the_normal_step(tmp_path, first, then):
    # the reference: the normal step saved after 2 steps and resumed with it to 4 (Lightning's resume as it is)
    _fit(False, tmp_path, "normal", max_steps=2)
    _, reference = _fit(False, tmp_path, "reference", resume=tmp_path / "normal.ckpt", max_steps=4)
    _, first_checkpoint = _fit(first, tmp_path, "first", max_steps=2)
    _assert_same_bits(first_checkpoint, torch.load(tmp_path / "normal.ckpt", weights_only=True))
    _, resumed = _fit(then, tmp_path, "resumed", resume=tmp_path / "first.ckpt", max_steps=4)
    _assert_same_bits(resumed, reference)


class Writes(L.LightningModule):
    """``tests/model_writes.py``'s model under SGD at ``lr``; one write of ``kind`` into it before step 1."""

    def __init__(self, kind: str, lr: float, tmp_path: Path) -> None:
        super().__init__()
        from tests.model_writes import Net as WriteNet

        self.model, self.kind, self.lr, self.tmp_path = WriteNet(), kind, lr, tmp_path
        self.expected: dict[str, torch.Tensor] = {}

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        from tests.model_writes import followed, write

        if self.trainer.global_step == 1:  # lean masters take a write in place whole: no earlier values needed
            self.expected = followed("remainder", {}, write(self.kind, self.model, "child", self.tmp_path))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0]).float().pow(2).mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _fit_writes(kind: str, lr: float, in_backward: bool, tmp_path: Path) -> Writes:
    with seeded():
        module = Writes(kind, lr, tmp_path)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
    loader = DataLoader(TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(1))), batch_size=8)
    make_trainer(plugin, max_steps=3).fit(module, loader)
    return module


@pytest.mark.parametrize("kind", ["load", "copy"])
def test_writes_into_the_model_after_setup_are_still_followed(tmp_path, kind):
    # at lr 0 the masters hold exactly what was written; at lr 0.1 the run equals the normal step's with the same
    # write (an in-place write must reach the masters before the update inside backward, not after it)
    still = _fit_writes(kind, 0.0, True, tmp_path)
    for name, value in still.expected.items():
        assert torch.equal(still.model.get_parameter(name), value), name
    ours, reference = _fit_writes(kind, 0.1, True, tmp_path), _fit_writes(kind, 0.1, False, tmp_path)
    for (name, value), expected in zip(ours.named_parameters(), reference.parameters()):
        assert value.dtype == torch.float32 and torch.equal(value, expected), name


# ---------------------------------------------------------------------- refusals, before any step
class Counting(Net):
    steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        Counting.steps += 1
        return super().training_step(batch, batch_idx)


def _plugin(**kw: Any) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin(**{"precision": "bf16-mixed", "master_weights": "remainder", **kw})


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (dict(master_weights=True), r"optimizer_in_backward=True\) needs master_weights='remainder'"),
        (dict(master_weights=False), r"needs master_weights='remainder', not False"),
        (dict(precision="16-mixed"), r"optimizer_in_backward=True\) needs precision='bf16-mixed', not '16-mixed'"),
        (dict(optimizer_in_backward="yes"), r"optimizer_in_backward='yes' must be True or False"),
    ],
)
def test_constructor_refuses_what_cannot_step_in_backward(arguments, message):
    with pytest.raises(ValueError, match=message):
        _plugin(**{"optimizer_in_backward": True, **arguments})


class LBFGS(Net):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


@pytest.mark.parametrize(
    ("module", "trainer", "message"),
    [
        (Net, dict(accumulate_grad_batches=2), r"cannot accumulate gradients \(accumulate_grad_batches=2\)"),
        (Net, dict(gradient_clip_val=1.0), r"cannot clip by the global norm.*gradient_clip_algorithm='value'"),
        (Net, dict(gradient_clip_val=1.0, gradient_clip_algorithm="norm"), r"cannot clip by the global norm"),
        (LBFGS, {}, r"cannot step torch.optim.lbfgs.LBFGS: its step\(\) needs a closure.*optimizer_in_backward=False"),
    ],
)
def test_trainer_setups_that_cannot_step_in_backward_are_refused_before_any_step(module, trainer, message):
    Counting.steps = 0
    model = type("Refused", (Counting, module), {})()
    with pytest.raises(ValueError, match=r"MixedPrecisionPlugin\(optimizer_in_backward=True\) " + message):
        make_trainer(_plugin(optimizer_in_backward=True), max_steps=1, **trainer).fit(model, _loader())
    assert Counting.steps == 0


def test_several_optimizers_and_sharded_strategies_are_refused():
    from lightning.fabric.strategies import DDPStrategy as FabricDDP
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from lightning_mp.master.in_backward import check_setup, check_strategy

    # Lightning refuses several optimizers in automatic optimization itself; the plugin's own check, directly (manual
    # optimization and Fabric: tests/test_in_backward_loops.py)
    net = nn.Linear(4, 4)
    two = [torch.optim.AdamW([net.weight]), torch.optim.AdamW([net.bias])]
    with pytest.raises(ValueError, match=r"takes exactly one optimizer, got 2 \(from configure_optimizers or fabric"):
        check_setup(None, net, two)

    check_strategy(DDPStrategy())  # DDP steps in backward: tests/test_in_backward_ddp.py
    check_strategy(FabricDDP(), fabric=True)  # Fabric's too: tests/test_in_backward_fabric_ddp.py
    check_strategy(ModelParallelStrategy())  # FSDP2 steps in backward: tests/test_in_backward_fsdp2.py
    with pytest.raises(ValueError, match=r"not available under Lightning Fabric's ModelParallelStrategy \(FSDP2\)"):
        check_strategy(ModelParallelStrategy(), fabric=True)
    with pytest.raises(ValueError, match=r"runs on one device, under DDP or FSDP2 only, not under FSDPStrategy"):
        check_strategy(FSDPStrategy())


def test_validation_during_and_after_fit_runs_without_updates(tmp_path):
    with seeded():
        model = Net()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    trainer = make_trainer(plugin, max_steps=3, limit_val_batches=2, val_check_interval=2)
    trainer.fit(model, _loader(), _loader(16))
    fitted = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer.validate(model, _loader(16))  # connect without optimizers: nothing to refuse, no hooks
    assert all(torch.equal(p, fitted[name]) for name, p in model.named_parameters())


def test_the_cli_passes_the_option_and_refuses_what_the_plugin_refuses():
    from lightning_mp.cli.choice import choose_precision
    from lightning_mp.cli.errors import CLIConfigError

    choice = choose_precision("bf16-mixed", "cpu", None, {"master_weights": "remainder", "optimizer_in_backward": True})
    assert choice.plugin is not None and choice.plugin.optimizer_in_backward is True
    with pytest.raises(CLIConfigError, match=r"optimizer_in_backward=True\) needs master_weights='remainder'"):
        choose_precision("bf16-mixed", "cpu", None, {"optimizer_in_backward": True})


def test_a_large_parameter_updated_inside_backward_on_one_or_two_threads_equals_the_threaded_step(monkeypatch):
    """Without a Trainer: the kernel inside backward on native.backward_threads threads (torch's two on the OpenMP
    build), on one thread (the build without OpenMP), and the normal step on two after backward (512 x 512 values:
    four units of native.GRAIN, shared by the threads): the same bits."""
    from lightning_mp.kernels import native
    from lightning_mp.master import RemainderMasters
    from lightning_mp.master.in_backward import StepInBackward

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # what the kernel reads
    assert 2 * native.GRAIN <= 512 * 512
    results = []
    backward_threads = native.backward_threads
    for in_backward, threads in ((True, None), (True, 1), (False, None)):
        monkeypatch.setattr(native, "backward_threads", (lambda n=threads: n) if threads else backward_threads)
        with seeded():
            model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 1))
        store = RemainderMasters()
        store.convert(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        store.attach([optimizer])
        stepper = StepInBackward(store, optimizer) if in_backward else None
        for step in range(3):
            x = torch.randn(8, 512, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            loss = model(x).float().pow(2).mean()
            if stepper is not None:
                stepper.begin(loss)
                loss.backward()
                assert stepper.finish().read() == (False, []) and model[0].weight.grad is None
            else:
                loss.backward()
                store.fused_step(optimizer, torch.zeros(()))
                optimizer.zero_grad()
        states = [optimizer.state[p][key] for p in model.parameters() for key in sorted(optimizer.state[p])]
        results.append([store.fp32_value(p) for p in model.parameters()] + states)
    assert len(results[0]) == len(results[1]) == len(results[2]) == 4 + 4 * 3  # weights, biases; step, moments
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], result))


def test_a_training_step_that_returns_none_updates_nothing():
    class Skips(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
            return None if batch_idx == 1 else super().training_step(batch, batch_idx)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.before = [self.trainer.precision_plugin.masters.fp32_value(p) for p in self.net[0].parameters()]

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            after = [self.trainer.precision_plugin.masters.fp32_value(p) for p in self.net[0].parameters()]
            self.changed.append(not all(torch.equal(a, b) for a, b in zip(self.before, after)))

    with seeded():
        model = Skips()
    model.changed = []
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    make_trainer(plugin, limit_train_batches=3).fit(model, _loader())
    assert model.changed == [True, False, True]  # the batch without a loss updated nothing
    assert plugin.scaler.skipped_steps == 0


def test_precision_monitor_records_skips_inside_backward_and_names_the_skipped_parameters(tmp_path):
    # the gradients are freed inside backward, so the step's own report is what names the skipped parameters; the
    # replay that localises a non-finite loss runs autograd.grad, which fires no post-accumulate-grad hook
    from lightning_mp import PrecisionMonitor

    monitor = PrecisionMonitor(sample_every=1)  # every step sampled: no parameter gradient is left to sample
    with pytest.warns(UserWarning, match="net.3.weight"), pytest.warns(UserWarning, match="freed inside backward"):
        _, ours = _fit(
            True, tmp_path, "ours", bad_loss_at=3, bad_grad_at=1, max_steps=4, callbacks=[monitor],
            default_root_dir=tmp_path,
        )  # fmt: skip
    assert monitor.history.skipped == [1, 3]
    # no gradient is left to sample but the probe's (net.3.bias: the smallest, kept by in_backward_zero_grads)
    assert {layer for sample in monitor.history.samples_of("param_grads") for layer in sample.layers} <= {"net.3"}
    assert (tmp_path / "precision_report.md").is_file()  # the report is written without gradient samples
    partial, whole = monitor.history.overflows
    assert partial.step == 1 and partial.nonfinite_params == ["net.3.weight"]
    assert "only these parameters' updates were skipped" in partial.note
    assert whole.step == 3 and whole.nonfinite_params == [] and whole.phase == "forward"  # the NaN loss, found
    # and the replays changed nothing: the same bits as the run without a monitor
    with pytest.warns(UserWarning, match="net.3.weight"):
        _, plain = _fit(True, tmp_path, "plain", bad_loss_at=3, bad_grad_at=1, max_steps=4)
    _assert_same_bits(ours, plain)


class FrozenFirst(Net):
    """``net.0.weight`` is in the optimizer but frozen (LoRA's base weights are, in LitGPT's recipes), unfrozen at
    step 2: no hook can be registered on it while frozen, and from step 2 it must be updated as the normal step does."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.trainer.global_step == 2:
            self.net[0].weight.requires_grad_(True)


def test_a_frozen_parameter_in_the_optimizer_is_left_alone_and_updated_once_unfrozen(tmp_path):
    def fit(in_backward: bool, steps: int) -> dict[str, Any]:
        with seeded():
            model = FrozenFirst()
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)
        trainer = make_trainer(plugin, max_steps=steps)
        trainer.fit(model, _loader())
        trainer.save_checkpoint(tmp_path / "last.ckpt")
        return torch.load(tmp_path / "last.ckpt", weights_only=True)

    with seeded():
        initial = FrozenFirst().net[0].weight.detach().clone()
    two = fit(True, 2)
    assert torch.equal(two["state_dict"]["net.0.weight"], initial)  # frozen: not updated
    _assert_same_bits(two, fit(False, 2))
    four = fit(True, 4)
    assert not torch.equal(four["state_dict"]["net.0.weight"], initial)  # unfrozen at step 2: updated since
    _assert_same_bits(four, fit(False, 4))


def test_an_agreed_loss_flag_is_zero_or_one_whatever_the_sum_over_ranks():
    # under DDP the loss flag is summed over the ranks: 2 when both losses are NaN. torch's fused kernels, which update
    # the fp32 parameters, skip only on a flag of exactly 1: a parameter whose gradient is finite under a NaN loss (a
    # NaN from another branch of the loss) would be updated. The flag every update reads is 0 or 1
    from lightning_mp.master import masters_for
    from lightning_mp.master.in_backward import StepInBackward

    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    store = masters_for(torch.bfloat16, "remainder", lambda name, module: isinstance(module, nn.LayerNorm))
    store.convert(net)
    optimizer = torch.optim.AdamW(net.parameters())
    store.attach([optimizer])
    steps = StepInBackward(store, optimizer)
    steps.begin(torch.tensor(float("nan")))
    steps.agree_on_loss(lambda flag: flag * 2)  # both ranks' NaN losses
    assert steps._flags.loss().item() == 1.0
    norm_weight = net[1].weight.detach().clone()
    net[1].weight.grad = torch.ones(4)  # finite, from a branch the NaN does not reach
    steps._update(net[1].weight)
    assert torch.equal(net[1].weight.detach(), norm_weight)  # skipped, as the whole step must be
    steps.remove()


class Unhooked(Net):
    """A parameter whose hook does not run (as under a strategy that does not call it): its gradient is left."""

    def on_train_start(self) -> None:
        in_backward = self.trainer.precision_plugin.steps.in_backward
        in_backward._hooks.pop(id(self.net[3].weight)).remove()
        in_backward._handed_over.add(id(self.net[3].weight))  # and it is not hooked again


def test_a_gradient_left_after_backward_fails_loudly_instead_of_leaving_its_parameter_behind(tmp_path):
    with seeded():
        model = Unhooked()
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) still hold a gradient after backward \(net\.3\.weight\)"):
        make_trainer(plugin, max_steps=2).fit(model, _loader())
    assert model.trainer.global_step == 0
