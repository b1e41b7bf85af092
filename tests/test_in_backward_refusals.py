"""Inside backward, every refusal of a change made during fit comes before any update of the step it concerns.

Each test changes something mid-fit as a user would (a callback setting ``trainer.gradient_clip_val``, Lightning's
``GradientAccumulationScheduler``, a callback raising ``trainer.accumulate_grad_batches``, a hook registered late),
and checks that the error names what changed and where, and that the weights and the optimizer state are those of
the last finished step when it is raised (snapshotted at the start of each batch, compared in ``on_exception``, before
teardown gives the fp32 weights back).
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler

from lightning_mp import MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded
from tests.test_in_backward import Net, _assert_same_bits, _loader


def _state(trainer: L.Trainer, module: L.LightningModule) -> list[torch.Tensor]:
    """The model's weights (bf16 + the fp32 LayerNorm) and every optimizer state tensor, copied."""
    tensors = [p.detach().clone() for p in module.parameters()]
    for state in trainer.optimizers[0].state.values():
        tensors += [value.clone() for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


class Unchanged(Callback):
    """Snapshots the training state at each batch start; at the error, whether it is still that snapshot."""

    def __init__(self) -> None:
        self.before: list[torch.Tensor] = []
        self.unchanged = None
        self.batches = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.before = _state(trainer, pl_module)
        self.batches += 1

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        after = _state(trainer, pl_module)
        self.unchanged = len(after) == len(self.before) and all(map(torch.equal, after, self.before))


class SetAtStep(Callback):
    """Sets Trainer attributes at the start of step ``step`` (as a user's callback would, mid-fit)."""

    def __init__(self, step: int, **settings: Any) -> None:
        self.step, self.settings = step, settings

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            for name, value in self.settings.items():
                setattr(trainer, name, value)


def _plugin(in_backward: bool = True) -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=in_backward)


def _refused(callback: Callback, error: type[Exception], match: str, steps: int = 4) -> Unchanged:
    unchanged = Unchanged()
    with seeded():
        model = Net()
    trainer = make_trainer(_plugin(), max_steps=steps, max_epochs=3, callbacks=[callback, unchanged])
    with pytest.raises(error, match=match):
        trainer.fit(model, _loader())
    return unchanged


def test_clipping_by_norm_switched_on_by_a_callback_is_refused_before_the_steps_updates():
    unchanged = _refused(
        SetAtStep(2, gradient_clip_val=1.0),
        ValueError,
        r"cannot clip by the global norm \(gradient_clip_val=1.0, gradient_clip_algorithm='norm' now, set during "
        r"fit \(by a callback or the LightningModule\)\).*stopped before it updated anything",
    )
    assert unchanged.batches == 3 and unchanged.unchanged  # steps 0 and 1 ran; step 2 updated nothing


def test_a_callback_raising_accumulate_grad_batches_mid_fit_is_refused_before_the_steps_updates():
    unchanged = _refused(
        SetAtStep(2, accumulate_grad_batches=2),
        ValueError,
        r"cannot accumulate gradients: Trainer.accumulate_grad_batches is 2 now, set by a callback or the "
        r"LightningModule during fit.*stopped before it updated anything",
    )
    assert unchanged.batches == 3 and unchanged.unchanged


def test_gradient_accumulation_scheduler_is_refused_at_setup_by_name():
    # Lightning's tests/tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py::
    # test_trainer_accumulate_grad_batches_with_callback trains with GradientAccumulationScheduler({1: 2, 3: 4});
    # inside backward nothing can accumulate: refused before the first step, naming the callback and its schedule
    # (Lightning adds epoch 0's factor 1 to it)
    unchanged = _refused(
        GradientAccumulationScheduler({1: 2, 3: 4}),
        ValueError,
        r"cannot accumulate gradients, and GradientAccumulationScheduler\(scheduling=\{1: 2, 3: 4, 0: 1\}\) would raise "
        r"Trainer.accumulate_grad_batches above 1 during fit",
    )
    assert unchanged.batches == 0


def test_gradient_accumulation_scheduler_that_never_accumulates_is_accepted():
    with seeded():
        model = Net()
    make_trainer(_plugin(), max_steps=2, callbacks=[GradientAccumulationScheduler({0: 1})]).fit(model, _loader())


class SchedulerAddedLate(Callback):
    """Puts a ``GradientAccumulationScheduler`` into the Trainer's callbacks after the plugin's setup (in
    ``on_fit_start``), so that the setup check cannot see it: the per-backward check names it."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.callbacks.append(GradientAccumulationScheduler({1: 2}))


def test_a_scheduler_the_setup_could_not_see_is_refused_by_name_before_the_epochs_updates():
    unchanged = _refused(
        SchedulerAddedLate(),
        ValueError,
        r"Trainer.accumulate_grad_batches is 2 now, set by GradientAccumulationScheduler\(scheduling=\{1: 2, 0: 1\}\) at "
        r"epoch 1.*stopped before it updated anything.*remove the scheduler",
        steps=12,
    )
    assert unchanged.batches == 7 and unchanged.unchanged  # epoch 0's 6 batches ran; epoch 1's first updated nothing


class LateHookAtStep(Callback):
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            pl_module.net[0].weight.register_post_accumulate_grad_hook(lambda param: None)


def test_a_post_accumulate_grad_hook_registered_mid_fit_is_refused_before_any_update_of_its_step():
    # net.0 is the last layer backward reaches: before, every other parameter had been updated when it was refused
    unchanged = _refused(
        LateHookAtStep(),
        RuntimeError,
        r"net\.0\.weight has a post-accumulate-grad hook registered after the plugin's.*stopped before it updated",
    )
    assert unchanged.batches == 3 and unchanged.unchanged


def test_clipping_by_value_switched_on_by_a_callback_is_followed_bitwise(tmp_path):
    def fit(in_backward: bool) -> dict[str, Any]:
        with seeded():
            model = Net()
        callback = SetAtStep(2, gradient_clip_val=0.05, gradient_clip_algorithm="value")
        trainer = make_trainer(_plugin(in_backward), max_steps=4, callbacks=[callback])
        trainer.fit(model, _loader())
        trainer.save_checkpoint(tmp_path / f"{in_backward}.ckpt")
        return torch.load(tmp_path / f"{in_backward}.ckpt", weights_only=True)

    _assert_same_bits(fit(True), fit(False))
