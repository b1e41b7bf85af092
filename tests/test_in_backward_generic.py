"""``optimizer_in_backward=True`` with any optimizer: its own ``step()`` on each parameter's fp32 slices inside
backward (:meth:`GenericChunkedStep.run_params <lightning_mp.master.lean.generic.GenericChunkedStep.run_params>`).

The reference of every run is the normal lean step (``optimizer_in_backward=False``) with the same optimizer, model,
data and seed: the fp32 weights a checkpoint holds and the optimizer's ``state_dict()`` (tensor subclasses: their
inner tensors) must be the same bits. torchao compiles its per-parameter step (a minute of CPU here): both sides run
the same function eagerly (``torch.compile`` made the identity), as tests/test_lean_masters.py does.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin, TensorSubclassCheckpointIO
from lightning_mp.master.lean.generic import leaves_of
from tests.helpers import generic_adamw8bit, live_cpu_bytes, make_trainer, seeded


class Lion(torch.optim.Optimizer):
    """Lion (the sign of an interpolated momentum) whose step size shrinks with a step count kept as a Python int in
    its param group: a group counter advanced more than once per step would change the numbers."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=0.1, steps=0))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["steps"] += 1
            beta1, beta2 = group["betas"]
            lr = group["lr"] / group["steps"] ** 0.5
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["exp_avg"] = torch.zeros_like(param)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(state["exp_avg"].lerp(param.grad, 1 - beta1).sign_(), alpha=-lr)
                state["exp_avg"].lerp_(param.grad, 1 - beta2)


class ForLoopAdamW(torch.optim.AdamW):
    """torch's for-loop AdamW, not exactly ``torch.optim.AdamW``: the generic path, not the one-pass kernel."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=1e-2, weight_decay=0.1, foreach=False)


def _adamw8bit(params: Any) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=1e-2, weight_decay=0.1)


def _adagrad_groups(model: nn.Module) -> Any:
    """Two param groups at different learning rates, both halved after every step by a step scheduler."""
    first, rest = list(model.net[0].parameters()), [p for m in list(model.net)[1:] for p in m.parameters()]
    optimizer = torch.optim.Adagrad([dict(params=first, lr=5e-2), dict(params=rest)], lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


# name -> (configure_optimizers(model), hidden width); AdamW8bit keeps 8-bit state for tensors of 4096+ elements
CASES: dict[str, tuple[Callable[[nn.Module], Any], int]] = {
    "torchao-adamw8bit": (lambda m: _adamw8bit(m.parameters()), 256),  # the one-pass 8-bit step (eightbit.py)
    "torchao-adamw8bit-generic": (lambda m: generic_adamw8bit(m.parameters(), lr=1e-2, weight_decay=0.1), 256),
    "torch-forloop-adamw": (lambda m: ForLoopAdamW(m.parameters()), 32),
    "rmsprop-centered-momentum": (lambda m: torch.optim.RMSprop(m.parameters(), 1e-3, momentum=0.9, centered=True), 32),
    "lion-group-counter": (lambda m: Lion(m.parameters()), 32),
    "adagrad-two-groups-steplr": (_adagrad_groups, 32),
}


class Net(L.LightningModule):
    """Linear (bf16 + remainder) -> LayerNorm (kept fp32) -> GELU -> Linear; the optimizer of ``case``."""

    def __init__(self, case: str, bad_loss_at: int = -1, bad_grad_at: int = -1) -> None:
        super().__init__()
        self.make, width = CASES[case]
        self.net = nn.Sequential(nn.Linear(16, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 1))
        self.bad_loss_at, self.bad_grad_at = bad_loss_at, bad_grad_at
        self.grads_after_step: list[Optional[torch.Tensor]] = []
        self.lrs: list[list[float]] = []
        if bad_grad_at >= 0:  # an inf in net.3.weight's gradient, as soon as autograd has produced it
            self.net[3].weight.register_hook(self._poison)

    def _poison(self, grad: torch.Tensor) -> torch.Tensor:
        if self.trainer.global_step == self.bad_grad_at:
            grad = grad.clone()
            grad[0, 0] = float("inf")
        return grad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        return loss * float("nan") if self.trainer.global_step == self.bad_loss_at else loss

    def on_train_batch_end(self, *args: Any) -> None:
        probe = min(self.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
        self.grads_after_step += [p.grad for p in self.parameters() if p is not probe]
        self.lrs.append([float(g["lr"]) for g in self.trainer.optimizers[0].param_groups])

    def configure_optimizers(self) -> Any:
        return self.make(self)


def _loader(n: int = 48) -> DataLoader:
    x = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


@pytest.fixture(autouse=True)
def _eager_torchao(monkeypatch, request):
    if "torchao" in request.node.name:
        pytest.importorskip("torchao.optim", reason="torchao is not installed: AdamW8bit cannot be tested")
        monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


def _fit(in_backward: bool, tmp_path: Path, name: str, case: str, resume: Optional[Path] = None, **kw: Any) -> Any:
    """Fit a fresh seeded :class:`Net`; (the model, the checkpoint written at the end)."""
    model_kw = {k: kw.pop(k) for k in ("bad_loss_at", "bad_grad_at") if k in kw}
    with seeded():
        model = Net(case, **model_kw)
    # zero_grad_after_step=False: the normal step holds its gradients after the step (inside backward: freed anyway)
    plugin = MixedPrecisionPlugin(
        "bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward, zero_grad_after_step=False
    )
    # torchao's 8-bit state holds tensor subclasses: Lightning's own checkpoint IO cannot load them (its callable
    # map_location), lightning_mp.TensorSubclassCheckpointIO can
    trainer = make_trainer([plugin, TensorSubclassCheckpointIO()], **kw)
    trainer.fit(model, _loader(), ckpt_path=resume)
    trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
    return model, torch.load(tmp_path / f"{name}.ckpt", weights_only=False)  # torchao's state: tensor subclasses


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ours, theirs = leaves_of(a), leaves_of(b)
        return type(a) is type(b) and len(ours) == len(theirs) and all(map(torch.equal, ours, theirs))
    return a == b


def _assert_same_bits(ours: dict[str, Any], reference: dict[str, Any], skip_state: Optional[set[int]] = None) -> None:
    assert ours["state_dict"].keys() == reference["state_dict"].keys()
    for key, value in reference["state_dict"].items():
        assert value.dtype == torch.float32 and torch.equal(ours["state_dict"][key], value), key
    optimizer, expected = ours["optimizer_states"][0], reference["optimizer_states"][0]
    assert optimizer["state"].keys() == expected["state"].keys() and optimizer["state"]
    for index, state in expected["state"].items():
        assert optimizer["state"][index].keys() == state.keys()
        assert all(_same(optimizer["state"][index][k], v) for k, v in state.items()), index
    for group, expected_group in zip(optimizer["param_groups"], expected["param_groups"]):
        assert group.keys() == expected_group.keys() and all(_same(group[k], v) for k, v in expected_group.items())
    assert ours["global_step"] == reference["global_step"]


@pytest.mark.parametrize("case", list(CASES))
def test_any_optimizer_in_backward_equals_the_normal_lean_step_bitwise_and_frees_the_gradients(tmp_path, case):
    model, ours = _fit(True, tmp_path, "ours", case, max_steps=4)
    reference_model, reference = _fit(False, tmp_path, "reference", case, max_steps=4)
    _assert_same_bits(ours, reference)
    assert ours["global_step"] == 4 and model.lrs == reference_model.lrs
    assert all(grad is None for grad in model.grads_after_step)  # each freed as soon as its parameter was updated
    assert any(grad is not None for grad in reference_model.grads_after_step)  # the normal step holds them
    groups = ours["optimizer_states"][0]["param_groups"]
    if case == "lion-group-counter":
        assert [g["steps"] for g in groups] == [4]  # advanced once per step, not once per parameter
    if case == "adagrad-two-groups-steplr":
        assert model.lrs[-1] == [5e-2 / 16, 1e-2 / 16]
    if case.startswith("torchao-adamw8bit"):  # the 256x16 weight: 8-bit moments; the rest (< 4096 elements) fp32
        kinds = [type(s["exp_avg"]).__name__ for s in ours["optimizer_states"][0]["state"].values()]
        assert kinds.count("OptimState8bit") == 1 and torch.equal(groups[0]["lr"], torch.tensor(1e-2))


@pytest.mark.parametrize("case", ["lion-group-counter", "rmsprop-centered-momentum"])
def test_a_non_finite_loss_skips_every_update_and_the_group_counters(tmp_path, case):
    _, ours = _fit(True, tmp_path, "ours", case, bad_loss_at=2, max_steps=3)
    _, reference = _fit(False, tmp_path, "reference", case, bad_loss_at=2, max_steps=3)
    _assert_same_bits(ours, reference)
    _, two = _fit(True, tmp_path, "two", case, max_steps=2)
    for key, value in two["state_dict"].items():  # step 2 left every weight as it was
        assert torch.equal(ours["state_dict"][key], value), key
    if case == "lion-group-counter":
        assert ours["optimizer_states"][0]["param_groups"][0]["steps"] == 2


@pytest.mark.parametrize("case", ["lion-group-counter", "torchao-adamw8bit"])
def test_a_non_finite_gradient_skips_that_parameter_only_and_is_reported(tmp_path, case):
    with pytest.warns(UserWarning, match=r"non-finite gradients in 1 parameter\(s\) \(net\.3\.weight\)"):
        _, ours = _fit(True, tmp_path, "ours", case, bad_grad_at=1, max_steps=2)
    _, one = _fit(True, tmp_path, "one", case, max_steps=1)
    _, two = _fit(True, tmp_path, "two", case, max_steps=2)
    index = list(dict(Net(case).named_parameters())).index("net.3.weight")
    for key, value in ours["state_dict"].items():
        expected = one if key == "net.3.weight" else two  # that parameter as after step 1, the others stepped
        assert torch.equal(value, expected["state_dict"][key]), key
    for i, state in ours["optimizer_states"][0]["state"].items():
        expected = one if i == index else two
        assert all(_same(v, expected["optimizer_states"][0]["state"][i][k]) for k, v in state.items()), i
    if case == "lion-group-counter":  # the group counter advances once: the other parameters stepped
        assert ours["optimizer_states"][0]["param_groups"][0]["steps"] == 2


@pytest.mark.parametrize("case", ["torchao-adamw8bit", "rmsprop-centered-momentum"])
@pytest.mark.parametrize(("first", "then"), [(True, False), (False, True)])
def test_checkpoints_move_between_in_backward_and_the_normal_step(tmp_path, case, first, then):
    _fit(False, tmp_path, "normal", case, max_steps=2)
    _, reference = _fit(False, tmp_path, "reference", case, resume=tmp_path / "normal.ckpt", max_steps=4)
    _, first_checkpoint = _fit(first, tmp_path, "first", case, max_steps=2)
    _assert_same_bits(first_checkpoint, torch.load(tmp_path / "normal.ckpt", weights_only=False))
    _, resumed = _fit(then, tmp_path, "resumed", case, resume=tmp_path / "first.ckpt", max_steps=4)
    _assert_same_bits(resumed, reference)


def test_a_masked_skip_of_one_parameter_keeps_the_others_and_the_group_options_exact():
    """The GPU's way (a device flag, no host read) on the CPU: ``run_params(..., on_host=False)``. torchao's lr and
    torch-optimi's counter are tensors in the param group; here a tensor counter stands for them."""
    from lightning_mp.master import RemainderMasters

    class TensorCounterSGD(torch.optim.SGD):  # generic path; a tensor step count in the group scales the step
        def __init__(self, params: Any) -> None:
            super().__init__(params, lr=1e-2, momentum=0.9)
            self.param_groups[0]["count"] = torch.zeros(())

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            self.param_groups[0]["count"] += 1
            super().step()

    runs = {}
    for flags in ((0, 0, 0, 0), (0, 1, 0, 1), (1, 1, 1, 1)):  # per parameter at step 3 (the last one skipped too)
        with seeded():
            model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
        store = RemainderMasters(chunk_size=32768)
        store.convert(model)
        optimizer = TensorCounterSGD(model.parameters())
        store.attach([optimizer])
        generic = store.updates.of(optimizer).generic
        for step in range(3):
            if step == 2:  # before step 3: the values and momenta a skipped parameter must keep
                before = _values_and_momenta(store, model, optimizer)
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            model(x).float().pow(2).mean().backward()
            generic.begin_params()
            for param, flag in zip(model.parameters(), flags if step == 2 else (0, 0, 0, 0)):
                generic.run_params([param], torch.tensor(float(flag)), [], on_host=False)
                param.grad = None
        assert generic.masks_on_device  # learnt on the steps before: the third is masked, no host read
        runs[flags] = (before, _values_and_momenta(store, model, optimizer), float(optimizer.param_groups[0]["count"]))
    (before, stepped, count), (_, one, one_count), (_, none, none_count) = runs.values()
    assert (count, one_count, none_count) == (3.0, 3.0, 2.0)  # advanced when any parameter stepped, else not
    for index in range(4):
        expected = before if index in (1, 3) else stepped
        assert torch.equal(one[0][index], expected[0][index]) and torch.equal(one[1][index], expected[1][index])
        assert torch.equal(none[0][index], before[0][index]) and torch.equal(none[1][index], before[1][index])


def _values_and_momenta(store: Any, model: nn.Module, optimizer: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    momenta = [state["momentum_buffer"].clone() for state in optimizer.state_dict()["state"].values()]
    return [store.fp32_value(p).clone() for p in model.parameters()], momenta


def _at_rest(in_backward: bool) -> tuple[float, float, bool]:
    """(bytes/param of live tensors after the second step, the same without the store's fp32 staging buffers, whether
    a gradient is held), four 256x256 layers under AdamW8bit, steps in Lightning's order (gradients set to None
    just before each backward, so the normal step holds them from its backward to the next one)."""
    gc.collect()
    gc.freeze()  # the session's older objects out of the counts' walk (they are not this run's); unfrozen below
    try:
        return _counted_at_rest(in_backward)
    finally:
        gc.unfreeze()


def _counted_at_rest(in_backward: bool) -> tuple[float, float, bool]:
    from torchao.optim import AdamW8bit

    from lightning_mp.master import RemainderMasters
    from lightning_mp.master.in_backward import StepInBackward

    base = live_cpu_bytes()
    with seeded():
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    store = RemainderMasters(chunk_size=32768)
    store.convert(model)
    optimizer = AdamW8bit(model.parameters(), lr=1e-3)
    store.attach([optimizer])
    stepper = StepInBackward(store, optimizer) if in_backward else None
    for step in range(2):
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
        loss = model(x).float().pow(2).mean()
        optimizer.zero_grad()
        if stepper is not None:
            stepper.begin(loss)
            loss.backward()
            assert stepper.finish().read() == (False, [])
        else:
            loss.backward()
            store.fused_step(optimizer, torch.zeros(()))
        del x, loss
    params = sum(p.numel() for p in model.parameters())
    staging = sum(t.untyped_storage().nbytes() for pair in store.updates.staging._buffers.values() for t in pair)
    live = live_cpu_bytes() - base
    probe = min(model.parameters(), key=torch.Tensor.numel)  # its gradient kept: the probe of zero_grad
    held = any(p.grad is not None for p in model.parameters() if p is not probe)
    return live / params, (live - staging) / params, held


def test_adamw8bit_in_backward_holds_no_gradient_at_rest_and_two_bytes_per_param_less(monkeypatch):
    """Measured here: in backward 7.11 bytes/param at rest (6.12 without the 256 KiB of staging), the normal lean
    step 9.11 (8.12): bf16 weight 2 + remainder 2 + 8-bit moments and their scales ~2.1 (+ bf16 gradient 2, the
    normal step only); the step inside backward keeps its flag vector instead (in_backward_flags: one fp32 slot per
    parameter tensor, one for the loss, and a 1.0 for the check: 40 bytes for these 8 tensors)."""
    pytest.importorskip("torchao.optim", reason="torchao is not installed: AdamW8bit cannot be measured")
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    ours, ours_without_staging, ours_held = _at_rest(True)
    normal, normal_without_staging, normal_held = _at_rest(False)
    print(f"at rest, bytes/param: in backward {ours:.2f} ({ours_without_staging:.2f} without staging), "
          f"normal {normal:.2f} ({normal_without_staging:.2f})")  # fmt: skip
    assert not ours_held and normal_held  # the normal step holds its bf16 gradients until the next backward
    params = 4 * (256 * 256 + 256)
    tensors = 8
    probe = 2 * 256  # the smallest parameter (a bias) keeps a bf16 gradient of zeros: the probe of zero_grad
    assert (normal - ours) * params >= 2 * params - 4 * (tensors + 2) - probe  # the bf16 gradients, less the flags
    assert ours_without_staging <= 6.3  # the goal for AdamW8bit (a real model's staging is negligible)
