"""The plugin's one promise, over the whole matrix of paths.

Invariant: every ``optimizer.step()`` the plugin lets through saw gradients unscaled exactly once since the last
backward, and every step with non-finite gradients was skipped. Checked for automatic and manual optimization x
clipping none / norm / value x ``accumulate_grad_batches`` 1 and 3 x a ``training_step`` that returns ``None`` or
not x master weights off / on x one and two optimizers (manual only: Lightning's automatic optimization takes one),
on a model with a tied parameter, with an inf injected at a known step. The weights are compared with an fp32
run (no plugin) that skips the same step by hand and where nothing overflows.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import DynamicLossScaler, MixedPrecisionPlugin
from tests.helpers import make_trainer, seeded

BATCH = 8
CLIPS = {"none": None, "norm": ("norm", 0.5), "value": ("value", 0.02)}


class MatrixModel(L.LightningModule):
    """embed -> mid -> head (tied to embed) -> out, MSE loss. Batch-indexed events: a ``None`` step, an inf."""

    def __init__(
        self,
        manual: bool,
        clip: Optional[tuple[str, float]],
        accumulate: int,
        none_step: bool,
        two_optimizers: bool,
        reference: bool,
    ) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.embed = nn.Linear(4, 4, bias=False)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two names
        self.out = nn.Linear(4, 1)
        self.clip, self.accumulate, self.two_optimizers, self.reference = clip, accumulate, two_optimizers, reference
        # the None step is the first micro-batch of window 1; the inf lands in window 2 (first micro-batch)
        self.none_batch = accumulate if none_step else -1
        self.inject_batch = 2 * accumulate
        self._batch_idx = -1
        self._plant_handle: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.head(torch.tanh(self.mid(self.embed(x))))))

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def _plant_inf(self) -> None:
        # the inf is planted in the gradient of the second optimizer's parameter (with one optimizer: the only
        # one) during backward, so it reaches the fp32 masters too
        if not self.reference and self._batch_idx == self.inject_batch:

            def plant(grad: torch.Tensor) -> torch.Tensor:
                grad = grad.clone()
                grad[0, 0] = float("inf")
                return grad

            self._plant_handle = self.out.weight.register_hook(plant)

    def on_after_backward(self) -> None:
        if self._plant_handle is not None:
            self._plant_handle.remove()
            self._plant_handle = None

    def training_step(self, batch: Any, batch_idx: int) -> Optional[torch.Tensor]:
        self._batch_idx = batch_idx
        if batch_idx == self.none_batch:
            return None
        self._plant_inf()
        if self.automatic_optimization:
            return self._loss(batch)
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        self.manual_backward(self._loss(batch))
        last_micro_batch = (batch_idx + 1) % self.accumulate == 0
        for index, optimizer in enumerate(optimizers):
            if self.clip is not None:  # clip every micro-batch, step every `accumulate`: the hard pattern
                self.clip_gradients(optimizer, gradient_clip_val=self.clip[1], gradient_clip_algorithm=self.clip[0])
            if last_micro_batch:
                skip_by_hand = self.reference and batch_idx // self.accumulate == 2 and index == len(optimizers) - 1
                if not skip_by_hand:
                    optimizer.step()
                optimizer.zero_grad()
        return None

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        if self.reference and batch_idx // self.accumulate == 2:
            optimizer_closure()  # the fp32 reference skips the injected step by hand
            return
        optimizer.step(closure=optimizer_closure)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        # Lightning's own fp32 path fails on value clipping with no gradients (a None step); the plugin skips it
        if self.reference and all(p.grad is None for p in self.parameters()):
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def configure_optimizers(self) -> Any:
        if self.two_optimizers:
            first = [self.embed.weight, *self.mid.parameters()]
            return [torch.optim.SGD(first, lr=0.05, momentum=0.9), torch.optim.SGD(self.out.parameters(), lr=0.05)]
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class EventLog(L.Callback):
    """Records backward starts (B), unscales (U) and optimizer steps (S), each U and S with its parameter set."""

    def __init__(self, plugin: MixedPrecisionPlugin) -> None:
        self.events: list[tuple[str, frozenset[int]]] = []
        scaler, pre_backward = plugin.scaler, plugin.pre_backward
        assert scaler is not None
        unscale = scaler.unscale_

        def logged_unscale(named: Any) -> torch.Tensor:
            named = list(named)
            self.events.append(("U", frozenset(id(p) for _, p in named)))
            return unscale(named)

        def logged_pre_backward(tensor: torch.Tensor, module: Any) -> torch.Tensor:
            self.events.append(("B", frozenset()))
            return pre_backward(tensor, module)

        scaler.unscale_ = logged_unscale  # type: ignore[method-assign]
        plugin.pre_backward = logged_pre_backward  # type: ignore[method-assign]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:  # after connect: with masters these hold the fp32 masters

            def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                self.events.append(("S", frozenset(id(p) for g in opt.param_groups for p in g["params"])))

            optimizer.register_step_pre_hook(hook)

    def check_each_step_unscaled_exactly_once(self) -> int:
        unscaled: dict[frozenset[int], int] = {}
        steps = 0
        for kind, params in self.events:
            if kind == "B":
                unscaled.clear()
            elif kind == "U":
                unscaled[params] = unscaled.get(params, 0) + 1
            else:
                steps += 1
                assert unscaled.get(params, 0) == 1, (
                    f"a step saw its gradients unscaled {unscaled.get(params, 0)} times"
                )
        return steps


def _loader(accumulate: int) -> DataLoader:
    batches = 4 * accumulate
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batches * BATCH, 4, generator=gen)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def _run(
    manual: bool,
    clip: str,
    accumulate: int,
    none_step: bool,
    two_optimizers: bool,
    plugin: Optional[MixedPrecisionPlugin],
) -> tuple[MatrixModel, Optional[EventLog]]:
    with seeded():
        model = MatrixModel(manual, CLIPS[clip], accumulate, none_step, two_optimizers, reference=plugin is None)
    log = EventLog(plugin) if plugin is not None else None
    kwargs: dict[str, Any] = {}
    if not manual:
        kwargs["accumulate_grad_batches"] = accumulate
        if CLIPS[clip] is not None:
            kwargs.update(gradient_clip_algorithm=CLIPS[clip][0], gradient_clip_val=CLIPS[clip][1])
    trainer = make_trainer(plugin, callbacks=[log] if log else [], **kwargs)
    trainer.fit(model, _loader(accumulate))
    return model, log


_REFERENCES: dict[tuple[Any, ...], dict[str, torch.Tensor]] = {}

MATRIX = [
    (manual, clip, accumulate, none_step, masters, two)
    for manual, clip, accumulate, none_step, masters, two in itertools.product(
        (False, True), CLIPS, (1, 3), (False, True), (False, True), (False, True)
    )
    if manual or not two  # Lightning's automatic optimization drives one optimizer
]


@pytest.mark.parametrize("manual, clip, accumulate, none_step, masters, two_optimizers", MATRIX)
def test_every_step_sees_gradients_unscaled_exactly_once_and_nonfinite_steps_are_skipped(
    manual, clip, accumulate, none_step, masters, two_optimizers
):
    key = (manual, clip, accumulate, none_step, two_optimizers)
    if key not in _REFERENCES:
        reference, _ = _run(*key, plugin=None)
        _REFERENCES[key] = {name: p.detach().clone() for name, p in reference.named_parameters()}
    expected = _REFERENCES[key]
    with seeded():
        initial = {
            name: p.detach().clone()
            for name, p in MatrixModel(
                manual, CLIPS[clip], accumulate, none_step, two_optimizers, reference=True
            ).named_parameters()
        }

    plugin = MixedPrecisionPlugin(
        scaler=DynamicLossScaler(init_scale=1024.0, growth_interval=1000), master_weights=masters
    )
    model, log = _run(*key, plugin=plugin)
    assert log is not None and plugin.scaler is not None

    steps = log.check_each_step_unscaled_exactly_once()
    windows = 4 - (1 if none_step and accumulate == 1 else 0)  # a None step in a window of one steps nothing
    assert steps == windows * (2 if two_optimizers else 1) - 1  # the injected window's (second) optimizer skips
    assert plugin.scaler.skipped_steps == 1
    assert model.head.weight is model.embed.weight
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32 and torch.isfinite(param).all(), name
        update, reference_update = param.detach() - initial[name], expected[name] - initial[name]
        error = float((update - reference_update).norm() / reference_update.norm().clamp_min(1e-6))
        assert error < 0.05, f"{name}: update differs from the fp32 reference by {error:.3f} (relative)"
