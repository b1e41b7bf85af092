"""The plans' fast forms inside backward (:meth:`StepPlan.make_fast <lightning_mp.master.lean.plan.StepPlan.make_fast>`,
one C call per hook, chosen by :meth:`LeanUpdate.run_param <lightning_mp.master.lean.update.LeanUpdate.run_param>`):
taken from the third step on, bitwise the normal lean step over the optimizers, a scheduler, clipping by value, a
non-finite gradient or loss met on the fast path, and state edited between steps (dropped and made again)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_mp.master.lean.plan import StepPlan
from lightning_mp.master.lean.update import LeanUpdate
from tests.test_in_backward import OPTIMIZERS, Net, _assert_same_bits, _fit


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per hook (each :meth:`LeanUpdate.run_param`), whether the parameter's fast form ran."""
    results: list[bool] = []
    run_fast, run_param = StepPlan.run_fast, LeanUpdate.run_param

    def spy_fast(self: Any, param: torch.Tensor) -> bool:
        results[-1] = run_fast(self, param)
        return results[-1]

    def spy_param(self: Any, *args: Any) -> None:
        results.append(False)
        run_param(self, *args)

    monkeypatch.setattr(StepPlan, "run_fast", spy_fast)
    monkeypatch.setattr(LeanUpdate, "run_param", spy_param)
    return results


def _tensors() -> int:
    return len(list(Net().parameters()))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fast_forms_equal_the_normal_lean_step_bitwise(tmp_path, taken, optimizer):
    _, ours = _fit(True, tmp_path, "ours", optimizer, max_steps=6)
    _, reference = _fit(False, tmp_path, "reference", optimizer, max_steps=6)
    _assert_same_bits(ours, reference)
    # steps 1-2 lay out the plans and make the fast forms (the state the first step made is a change at the
    # second's begin); from the third on every parameter's, lean (the Linears') and kept in fp32 (the LayerNorm's)
    assert taken[: _tensors() * 2].count(True) == 0
    assert len(taken) == _tensors() * 6 and all(taken[_tensors() * 2 :])


def test_fast_forms_follow_a_scheduler_and_clipping_by_value_bitwise(tmp_path, taken):
    kw = dict(scheduler=True, gradient_clip_val=0.05, gradient_clip_algorithm="value", max_steps=6)
    ours_model, ours = _fit(True, tmp_path, "ours", **kw)
    reference_model, reference = _fit(False, tmp_path, "reference", **kw)
    assert ours_model.lrs == reference_model.lrs and len(set(ours_model.lrs)) == 6
    _assert_same_bits(ours, reference)
    # clipped by value inside the kernel: every parameter's, lean and kept in fp32 (the LayerNorm's) alike
    assert sum(isinstance(m, torch.nn.LayerNorm) for m in ours_model.modules())  # kept fp32 by the policy
    assert taken[_tensors() * 2 :].count(True) == _tensors() * 4


def _fit_without_fast_forms(monkeypatch: pytest.MonkeyPatch, *args: Any, **kw: Any) -> tuple[Net, dict[str, Any]]:
    """The same fit with every hook going the plan's way (no fast form made): the reference of the cache under test."""
    with monkeypatch.context() as patch:
        patch.setattr(StepPlan, "make_fast", lambda self, param, options, found: None)
        return _fit(True, *args, **kw)


@pytest.mark.parametrize("bad", ["bad_grad_at", "bad_loss_at"])
def test_a_non_finite_gradient_or_loss_on_the_fast_path_skips_as_the_plans_way(tmp_path, monkeypatch, taken, bad):
    model, ours = _fit(True, tmp_path, "ours", max_steps=6, **{bad: 4})
    assert taken[_tensors() * 4 :].count(True) > 0  # step 4 (0-based) ran fast forms
    taken.clear()
    reference_model, reference = _fit_without_fast_forms(monkeypatch, tmp_path, "reference", max_steps=6, **{bad: 4})
    assert taken.count(True) == 0
    _assert_same_bits(ours, reference)
    assert model.skipped_params == reference_model.skipped_params
    assert model.skipped_params[4] == (["net.3.weight"] if bad == "bad_grad_at" else [])
    assert model.trainer.precision_plugin.scaler.skipped_steps == 1
    if bad == "bad_loss_at":  # the whole step skipped, as by the normal step
        _assert_same_bits(ours, _fit(False, tmp_path, "normal", max_steps=6, **{bad: 4})[1])


def test_state_edited_between_steps_drops_the_fast_forms(tmp_path, monkeypatch, taken):
    """An edit between steps that moves a state tensor (``exp_avg.data = ...``), one that replaces it, and an fp32
    parameter's storage swapped: the next backward's check (following.seen) sees them, the fast forms are made again
    from the new plans; bitwise the run without them."""

    class Edits(Net):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.trainer.optimizers[0]
            state = optimizer.state[optimizer.param_groups[0]["params"][0]]
            if batch_idx == 3:
                state["exp_avg"].data = state["exp_avg"].data.clone() * 0.5
            if batch_idx == 4:
                state["exp_avg_sq"] = state["exp_avg_sq"].clone() * 2.0
            if batch_idx == 5:  # alone: the state is unchanged, the parameter's address is not
                norm = self.net[1].weight  # kept in fp32: updated in place, at its own address
                norm.data = norm.data.clone()

    def fit(**kw: Any) -> dict[str, Any]:
        from lightning_mp import MixedPrecisionPlugin
        from tests.helpers import make_trainer, seeded
        from tests.test_in_backward import _loader

        with seeded():
            model = Edits("adamw")
        plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True)
        trainer = make_trainer(plugin, max_steps=7)
        trainer.fit(model, _loader())
        path = tmp_path / f"{len(taken)}.ckpt"
        trainer.save_checkpoint(path)
        return torch.load(path, weights_only=True)

    ours = fit()
    assert not any(taken[_tensors() * 5 : _tensors() * 6]) and all(taken[_tensors() * 6 :])  # made again after it
    with monkeypatch.context() as patch:
        patch.setattr(StepPlan, "make_fast", lambda self, param, options, found: None)
        reference = fit()
    _assert_same_bits(ours, reference)


FP32_CASES = {
    "adamw": dict(kind="adamw", weight_decay=0.1),
    "adam_amsgrad_maximize": dict(kind="adam", weight_decay=0.01, amsgrad=True, maximize=True),
    "sgd_nesterov": dict(kind="sgd", momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_plain": dict(kind="sgd"),
}


@pytest.mark.parametrize("numel", [1, 7, 8, 37, 1029])  # tails of every length: the scalar tail's arithmetic too
@pytest.mark.parametrize("case", sorted(FP32_CASES))
def test_the_kernel_updates_fp32_weights_in_place_bitwise_torchs_fused_kernel(case, numel):
    """The piece without a remainder (a parameter kept in fp32), 4 steps with step 3 skipped by its flag: bitwise
    torch's fused kernel as the plan's way runs it on such a parameter (the entry's ``run``, with ``found_inf``)."""
    from lightning_mp.kernels import native
    from lightning_mp.master.lean.optimizers import entry_for
    from lightning_mp.master.lean.plan import kernel_options

    if native.cpu_kernel() is None:
        pytest.skip("no C compiler")
    options = dict(FP32_CASES[case])
    make = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[options.pop("kind")]
    generator = torch.Generator().manual_seed(numel)
    start = torch.randn(numel, generator=generator)
    optimizer = make([torch.nn.Parameter(start.clone())], lr=1e-2, **options)
    entry = entry_for(optimizer)
    group = optimizer.param_groups[0]
    keys = entry.keys(group)
    sides = []  # (weight, states, step) for the kernel, then for torch's fused kernel
    for _ in range(2):
        states = [torch.zeros(numel) for _ in keys]
        sides.append((start.clone(), states, torch.zeros(())))
    (weight, states, step), (their_weight, their_states, their_step) = sides
    for index in range(4):
        grad = torch.randn(numel, generator=generator)
        found = torch.tensor(float(index == 2))
        first = index == 0
        if entry.counts_steps:
            step += 1
            their_step += 1
        made = kernel_options(entry, group, first, None, None)
        made.grad_fp32 = 1  # native.run gives every piece the options' gradient dtype
        addresses = [t.data_ptr() for t in states] + [None] * (3 - len(states))
        piece = native.Piece(weight.data_ptr(), None, grad.data_ptr(), *addresses,
                             step.data_ptr() if entry.counts_steps else None, numel, 1)  # fmt: skip
        native.run([piece], made, found)
        scalars = [[their_step]] if entry.counts_steps else []
        tensors = [[t] for t in their_states]
        entry.run(group, [their_weight], [grad], tensors, scalars, float(group["lr"]), found, first)
        if entry.counts_steps:
            step -= found
            their_step -= found
        assert torch.equal(weight, their_weight), index
        for ours, theirs in zip(states, their_states):
            assert torch.equal(ours, theirs), index
    assert not torch.equal(weight, start)
