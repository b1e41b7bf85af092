"""Overflow localisation: when the scaler skips a step, replay it under :class:`NonFiniteTrace` to find where the
inf/NaN was born, and why.

Nothing runs on steps that are not skipped except :meth:`OverflowLocaliser.remember`, which keeps a reference to
each micro-batch of the current accumulation window and a copy of the RNG state before it (a few KB of host
memory; no device work, no synchronisation, no hooks). On a skipped step (automatic optimization), each remembered
micro-batch is replayed until one reproduces the non-finite values:

1. **as trained**: the plugin's forward context (autocast + casting policy), ``training_step``, the loss divided by
   ``accumulate_grad_batches`` and multiplied by the scale the gradients carried, and its gradients with respect to
   the parameters, all under :class:`NonFiniteTrace`. The origin gives module, class, forward/backward, operation and
   the largest finite magnitude at its input. If nothing is non-finite, the cause is ``not_reproduced``.
2. for a backward origin, **unscaled** (scale 1), same precision: finite -> cause ``loss_scale``.
3. otherwise **in fp32, unscaled** (autocast off, the casting policy's op overrides off, fp32 master values
   swapped into a half model): finite -> ``half_precision``, else ``model``.

Each replay runs the forward and, unless the forward already produced the inf/NaN, the backward: between one
and three replays of one micro-batch per skipped step (more with gradient accumulation when the overflow is in
an earlier micro-batch), at a few times the cost of a plain forward + backward each (every operation is checked)
and two host syncs per replay. ``OverflowRecord.seconds`` records what it cost.

What the replay leaves untouched: parameters and their ``.grad`` (gradients are computed with
``torch.autograd.grad``, never accumulated), the optimizer, the loss scaler (the scale is read, not used), module
buffers (BatchNorm statistics are copied back), torchmetrics states, the RNG (saved and restored; the replay
reuses the RNG state the micro-batch started with, so dropout draws the same masks), and Lightning's logging
(``self.log``/``self.log_dict`` do nothing during the replay). Other side effects of a user's ``training_step``
(appending to a list, counting calls) do happen again, and a ``training_step`` that modifies its batch in place
is replayed on the modified batch. In manual optimization the ``training_step`` steps the
optimizers itself and cannot be replayed: the record names the parameters with non-finite gradients only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_mp.diagnostics.history import OverflowRecord
from lightning_mp.diagnostics.nonfinite import NonFiniteTrace, Origin


@dataclass
class MicroBatch:
    """A micro-batch of the current accumulation window, as ``on_train_batch_start`` saw it."""

    batch: Any
    batch_idx: int
    cpu_rng: Tensor
    cuda_rng: Optional[Tensor]


class OverflowLocaliser:
    """Remembers the micro-batches of the current optimizer step and replays them when the step is skipped."""

    def __init__(self) -> None:
        self.window: list[MicroBatch] = []
        self._window_closed = False

    def remember(self, batch: Any, batch_idx: int, device: torch.device) -> None:
        """Called before every training micro-batch: a reference to ``batch`` and the RNG state (host copies)."""
        if self._window_closed:
            self.window, self._window_closed = [], False
        cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self.window.append(MicroBatch(batch, batch_idx, torch.get_rng_state(), cuda_rng))

    def step_decided(self) -> None:
        """The optimizer step of the window ran (or was skipped): the next micro-batch starts a new window."""
        self._window_closed = True

    def forget(self) -> None:
        self.window, self._window_closed = [], False

    def localise(self, plugin: Any, optimizer: Any, model: Any, step: int, names: dict[int, str]) -> OverflowRecord:
        """Find where the skipped step's inf/NaN came from; see the module docstring."""
        start = time.perf_counter()
        scaler = plugin.scaler
        record = OverflowRecord(step=step, scale_before=float(scaler.scale))
        record.nonfinite_params = nonfinite_params(optimizer, names)
        if not getattr(model, "automatic_optimization", True):
            record.cause = "gradients_only"
        elif not self.window:
            record.note = "no micro-batch was remembered for this step"
        else:
            scale = float(scaler.scale_of_grads()) if scaler.enabled and not scaler.check_only else 1.0
            accumulate = max(int(getattr(model.trainer, "accumulate_grad_batches", 1)), 1)
            for index, micro in enumerate(self.window):
                replay = _Replay(plugin, model, micro, accumulate)
                origin = replay.run(scale=scale, fp32=False)
                record.replays += 1
                if origin is None:
                    continue
                record.micro_batch = index
                record.phase, record.module, record.module_class = origin.phase, origin.module, origin.module_class
                record.op, record.input_amax = origin.op, origin.input_amax
                record.cause, record.replays = _classify(replay, origin, scale, record.replays)
                break
        record.seconds = time.perf_counter() - start
        return record


def _classify(replay: _Replay, origin: Origin, scale: float, replays: int) -> tuple[str, int]:
    if origin.phase == "backward" and scale != 1.0:
        replays += 1
        if replay.run(scale=1.0, fp32=False) is None:
            return "loss_scale", replays
    replays += 1
    return ("half_precision" if replay.run(scale=1.0, fp32=True) is None else "model"), replays


def nonfinite_params(optimizer: Any, names: dict[int, str]) -> list[str]:
    """Names of ``optimizer``'s parameters whose gradients hold inf/NaN (one host sync)."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return []
    device = params[0].grad.device
    flags = torch.stack([(~torch.isfinite(p.grad.detach()).all()).to(device) for p in params]).tolist()
    return [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p, bad in zip(params, flags) if bad]


class _Replay:
    """One micro-batch's forward and backward, run again with every side effect undone."""

    def __init__(self, plugin: Any, model: Any, micro: MicroBatch, accumulate: int) -> None:
        self.plugin, self.model, self.micro, self.accumulate = plugin, model, micro, accumulate
        self.device = _device_of(model)

    def run(self, scale: float, fp32: bool) -> Optional[Origin]:
        """Replay; the :class:`Origin` of the first inf/NaN, or ``None`` when everything stayed finite."""
        trace = NonFiniteTrace(self.model, self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _undone(self.model), _silenced_logging(self.model):
            torch.set_rng_state(self.micro.cpu_rng)
            if self.micro.cuda_rng is not None:
                torch.cuda.set_rng_state(self.micro.cuda_rng, self.device)
            with torch.enable_grad(), (_fp32_weights(self.model, self.plugin) if fp32 else contextlib.nullcontext()):
                with trace:
                    with _precision_context(self.plugin, fp32):
                        output = self.model.training_step(self.micro.batch, self.micro.batch_idx)
                    loss = _loss_of(output)
                    if loss is None:
                        return None
                    flags = trace.flags()  # forward's flags: a forward origin needs no backward
                    if trace.any_nonfinite(flags):
                        return trace.origin(flags)
                    params = [p for p in self.model.parameters() if p.requires_grad]
                    if params and loss.requires_grad:
                        scaled = loss.float() / self.accumulate * scale  # what the closure's backward started from
                        trace.phase = "backward"
                        torch.autograd.grad(scaled, params, allow_unused=True)
        return trace.origin()


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _loss_of(output: Any) -> Optional[Tensor]:
    if isinstance(output, dict):
        output = output.get("loss")
    return output if isinstance(output, Tensor) else None


def _precision_context(plugin: Any, fp32: bool) -> contextlib.AbstractContextManager:
    if fp32:
        return torch.autocast(plugin.device_type, enabled=False)
    return plugin.train_step_context()


@contextlib.contextmanager
def _fp32_weights(model: nn.Module, plugin: Any) -> Iterator[None]:
    """A half model (master weights) runs with its fp32 values: masters swapped in, half buffers upcast."""
    masters = getattr(plugin, "masters", None)
    swapped: list[tuple[Tensor, Tensor]] = []
    buffers: list[tuple[nn.Module, str, Tensor]] = []
    try:
        if masters is not None:  # lean masters have no fp32 tensors: their exact values are materialised here
            for param, master in (masters.fp32_pairs() if hasattr(masters, "fp32_pairs") else masters.pairs()):
                swapped.append((param, param.data))
                param.data = master.detach()
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.dtype in (torch.float16, torch.bfloat16):
                    buffers.append((module, name, buffer))
                    module._buffers[name] = buffer.float()
        yield
    finally:
        for param, half in swapped:
            param.data = half
        for module, name, buffer in buffers:
            module._buffers[name] = buffer


@contextlib.contextmanager
def _undone(model: nn.Module) -> Iterator[None]:
    """Module buffers (BatchNorm statistics, counters) and torchmetrics states are put back afterwards."""
    buffers = [(module, name, buffer.clone()) for module in model.modules()
               for name, buffer in module._buffers.items() if buffer is not None]
    metrics = [(module, _metric_state(module)) for module in model.modules() if hasattr(module, "_copy_state_dict")]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, saved in buffers:
                current = module._buffers.get(name)
                if current is not None and current.shape == saved.shape and current.dtype == saved.dtype:
                    current.copy_(saved)
                else:
                    module._buffers[name] = saved
        for module, state in metrics:
            for attr, value in state.items():
                setattr(module, attr, value)


def _metric_state(metric: Any) -> dict[str, Any]:
    state: dict[str, Any] = dict(metric._copy_state_dict())
    for attr in ("_update_count", "_computed", "_forward_cache"):
        if hasattr(metric, attr):
            state[attr] = getattr(metric, attr)
    return state


@contextlib.contextmanager
def _silenced_logging(model: nn.Module) -> Iterator[None]:
    """``self.log`` / ``self.log_dict`` do nothing during the replay, so the run's metrics are not counted twice."""
    saved = {name: model.__dict__[name] for name in ("log", "log_dict") if name in model.__dict__}
    model.__dict__["log"] = lambda *args, **kwargs: None
    model.__dict__["log_dict"] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            del model.__dict__[name]
            if name in saved:
                model.__dict__[name] = saved[name]
