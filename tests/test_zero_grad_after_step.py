"""``MixedPrecisionPlugin(zero_grad_after_step=...)``: the step's gradients freed right after it under the Trainer,
when asked.

Lightning zeroes an optimizer's gradients (``optimizer_zero_grad``: ``optimizer.zero_grad()``, which sets them to
``None``) after the *next* forward, so the gradients of a step and the next forward's activations are alive together.
By default the plugin keeps them as Lightning's built-in precision does (user code reads ``p.grad`` after the step:
``tests/test_observable_grads.py``); ``True`` frees them as soon as the step is done, ``None`` does so under automatic
optimization unless the module zeroes its own way. The invariant tested here: the weights and the optimizer state
are the same bits with the gradients freed after the step as with them kept until Lightning's zero_grad, over the
matrix of modes (no masters, fp16 with a skipped step, fp32 masters, lean masters), accumulation and clipping; where
the gradients are freed and where not; and what the peak gains (``tests/test_memory_budget.py`` holds the figures).
"""

from __future__ import annotations

import re
from typing import Any, Optional

import lightning as L
import pytest
import torch

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.stepping import overrides_zero_grad
from tests.helpers import TinyRegressor, make_trainer, regression_loader, seeded

MODES: dict[str, dict[str, Any]] = {
    "bf16-mixed": dict(precision="bf16-mixed"),
    "16-mixed, a skipped step": dict(precision="16-mixed"),
    "fp32 masters": dict(precision="bf16-mixed", master_weights=True),
    "lean masters": dict(precision="bf16-mixed", master_weights="remainder"),
}


class GradsSeen(L.Callback):
    """Whether any parameter the optimizer steps (the masters' with ``master_weights=True``) has a gradient at the
    end of each batch (after its step, if it stepped), and whether the model's parameters show the same."""

    def __init__(self) -> None:
        self.seen: list[bool] = []
        self.model_seen: list[bool] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
        self.seen.append(any(p.grad is not None for p in params))
        self.model_seen.append(any(p.grad is not None for p in pl_module.parameters()))


DEFAULT = "default"  # fit(): the plugin built without zero_grad_after_step


def fit(
    mode: str, setting: Any, accumulate: int = 1, clip: Optional[float] = None, module: Any = None
) -> tuple[L.LightningModule, Any, GradsSeen]:
    options = dict(MODES[mode])
    if setting != DEFAULT:
        options["zero_grad_after_step"] = setting
    with seeded(0):
        if module is None:
            inject = (1,) if "skipped" in mode else ()  # an inf gradient at step 1: a skipped step
            module = TinyRegressor(optimizer="adam", lr=0.01, inject_inf_at=inject)
        plugin = MixedPrecisionPlugin(**options)
        seen = GradsSeen()
        trainer = make_trainer(
            plugin, max_epochs=1, limit_train_batches=6, accumulate_grad_batches=accumulate,
            gradient_clip_val=clip, callbacks=[seen],
        )  # fmt: skip
        trainer.fit(module, regression_loader(n=48, batch_size=8))
    return module, trainer, seen


def state_of(trainer: L.Trainer) -> list[tuple[str, torch.Tensor]]:
    state = trainer.optimizers[0].state_dict()["state"]
    return [(f"{index}.{key}", value) for index, values in sorted(state.items()) for key, value in values.items()]


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no clipping", "clip by norm"])
@pytest.mark.parametrize("accumulate", [1, 2], ids=["every batch", "accumulate 2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_weights_are_the_same_bits_with_the_gradients_freed_after_the_step(
    mode: str, accumulate: int, clip: Optional[float]
) -> None:
    # freed: True, or None (automatic optimization: the same) for one mode; kept: the default
    freed, freed_trainer, freed_seen = fit(mode, None if mode == "bf16-mixed" else True, accumulate, clip)
    kept, kept_trainer, kept_seen = fit(mode, DEFAULT, accumulate, clip)
    for (name, a), b in zip(freed.named_parameters(), kept.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    freed_state, kept_state = state_of(freed_trainer), state_of(kept_trainer)
    assert len(freed_state) == len(kept_state) > 0
    for (name, a), (_, b) in zip(freed_state, kept_state):
        assert torch.equal(a, b), name
    if "skipped" in mode:  # the same steps were skipped in both (the injected inf's, and the first scale's overflow)
        skipped = freed_trainer.precision_plugin.scaler.skipped_steps
        assert skipped >= 1 and kept_trainer.precision_plugin.scaler.skipped_steps == skipped
    # freed right after each step (the step's batches: every accumulate-th), nowhere else; kept: alive at every batch end
    assert freed_seen.seen == freed_seen.model_seen == [(batch + 1) % accumulate != 0 for batch in range(6)]
    assert kept_seen.seen == kept_seen.model_seen == [True] * 6  # fp32 masters: the model shows the masters' ones


def test_a_module_that_zeroes_its_own_way_keeps_its_gradients_unless_asked() -> None:
    class ZeroInPlace(TinyRegressor):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            optimizer.zero_grad(set_to_none=False)  # zeros kept in place: the module's choice

    assert overrides_zero_grad(ZeroInPlace()) and not overrides_zero_grad(TinyRegressor())
    with seeded(0):
        own = ZeroInPlace(optimizer="adam", lr=0.01)
    _, _, seen = fit("lean masters", None, module=own)
    assert seen.seen == [True] * 6  # the plugin left them to the module's optimizer_zero_grad
    assert all(p.grad is not None for p in own.parameters())  # the last step's, until the module zeroes them
    with seeded(0):
        forced = ZeroInPlace(optimizer="adam", lr=0.01)
    _, _, seen = fit("lean masters", True, module=forced)
    assert seen.seen == [False] * 6  # True: after every step, whatever the module's zero_grad
    for a, b in zip(own.parameters(), forced.parameters()):  # zeros in place or None: the same update
        assert torch.equal(a, b)


class ManualModule(TinyRegressor):
    def __init__(self) -> None:
        super().__init__(optimizer="adam", lr=0.01)
        self.automatic_optimization = False
        self.after_step: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        optimizer.zero_grad()
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self(x).float(), y))
        optimizer.step()
        self.after_step.append(any(p.grad is not None for p in self.parameters()))


@pytest.mark.parametrize("setting", [DEFAULT, None, True])
def test_manual_optimization_keeps_the_gradients_unless_asked(setting: Any) -> None:
    with seeded(0):
        module = ManualModule()
    fit("lean masters", setting, module=module)
    assert module.after_step == [setting is not True] * 6  # the user's loop decides; True: freed after each step


def test_the_default_keeps_the_gradients_as_the_built_in_does() -> None:
    assert MixedPrecisionPlugin("bf16-mixed").steps.zero_grad_after_step is False
    _, _, seen = fit("lean masters", DEFAULT)
    assert seen.seen == [True] * 6  # on_train_batch_end finds the step's gradients, as under precision="bf16-mixed"


def test_pytorch_lightning_modules_are_recognised() -> None:
    pl = pytest.importorskip("pytorch_lightning")

    class Plain(pl.LightningModule):
        pass

    class Own(pl.LightningModule):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            pass

    assert not overrides_zero_grad(Plain()) and overrides_zero_grad(Own())


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_a_bad_setting_is_refused_by_name(value: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"zero_grad_after_step={value!r}) is not supported: use False")):
        MixedPrecisionPlugin("bf16-mixed", zero_grad_after_step=value)
