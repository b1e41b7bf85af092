"""Overflow localisation: when the scaler skips a step, replay it under :class:`NonFiniteTrace` to find where the
inf/NaN was born, and why.

Nothing runs on steps that are not skipped except :meth:`OverflowLocaliser.remember`, which keeps a reference to
each micro-batch of the current accumulation window and a copy of the RNG state before it (a few KB of host
memory; no device work, no synchronisation, no hooks). On a skipped step (automatic optimization), each remembered
micro-batch is replayed until one reproduces the non-finite values:

1. **as trained**: the plugin's forward context (autocast + casting policy), ``training_step``, the loss divided by
   ``accumulate_grad_batches`` and multiplied by the scale the gradients carried, and its gradients with respect to
   the parameters, all under :class:`NonFiniteTrace`. The origin is where the inf/NaN that reached the loss (or,
   with a finite loss, the gradients) was born: module, class, forward/backward, operation and the largest finite
   magnitude at its input. Non-finite values that reach neither (``-inf`` attention masks) do not count. If the
   loss and the gradients are finite, the cause is ``not_reproduced``.
2. for a backward origin, **unscaled** (scale 1), same precision: finite -> cause ``loss_scale``.
3. otherwise **in fp32, unscaled** (autocast off, the casting policy's op overrides off, a half model's fp32 master
   values put in the modules' parameter slots): finite -> ``half_precision``, else ``model``.

Under a process group every rank replays in lockstep (the same replays in the same order, see
:meth:`OverflowLocaliser.localise`). A sharded model (FSDP2: DTensor parameters) is not replayed: the record is
``gradients_only``, with each rank's non-finite gradient shards.

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
from lightning_mp.diagnostics.skipped import SkippedStep


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

    def localise(
        self, skipped: SkippedStep, optimizer: Any, model: Any, step: int, names: dict[int, str]
    ) -> OverflowRecord:
        """Find where the skipped step's inf/NaN came from; see the module docstring.

        Every rank of a process group calls this on the same skipped step (the skip is agreed). The ranks replay in
        lockstep, the same replays in the same order whatever each one finds, so that any collective inside a
        ``training_step`` (SyncBatchNorm, ``all_gather``) is issued by every rank alike.
        """
        start = time.perf_counter()
        record = OverflowRecord(step=step, scale_before=skipped.scale)
        record.nonfinite_params = nonfinite_params(optimizer, names)
        if not getattr(model, "automatic_optimization", True):
            record.cause = "gradients_only"
        elif _sharded(model):
            record.cause = "gradients_only"
            record.note = (
                "FSDP2 shards the parameters: a replay would all-gather and reduce-scatter them and write "
                "the sharded gradients, so only the gradients are inspected"
            )
        elif not self.window:
            record.note = "no micro-batch was remembered for this step"
        else:
            scale = skipped.grads_scale
            accumulate = max(int(getattr(model.trainer, "accumulate_grad_batches", 1)), 1)
            lockstep = _world_size() > 1
            for index, micro in enumerate(self.window):
                replay = _Replay(skipped, model, micro, accumulate)
                origin = replay.run(scale=scale, fp32=False)
                record.replays += 1
                if not _any_rank(origin is not None, lockstep, replay.device):
                    continue
                # in lockstep every rank runs the classification replays; the ranks that found nothing ignore them
                cause, replays = _classify(replay, origin, scale, lockstep)
                record.replays += replays
                if origin is not None:
                    record.micro_batch = index
                    record.phase, record.module, record.module_class = origin.phase, origin.module, origin.module_class
                    record.op, record.input_amax, record.cause = origin.op, origin.input_amax, cause
                break
        record.seconds = time.perf_counter() - start
        return record


def _classify(replay: _Replay, origin: Optional[Origin], scale: float, lockstep: bool) -> tuple[str, int]:
    """The cause of ``origin`` and how many replays it took: a backward origin is replayed unscaled (finite ->
    ``loss_scale``), then in fp32 (finite -> ``half_precision``, else ``model``). In ``lockstep`` every rank runs
    both replays whatever its own origin (``None`` included), so that the ranks' collectives match."""
    backward = origin is not None and origin.phase == "backward" and scale != 1.0
    replays, unscaled = 0, origin
    if backward or (lockstep and scale != 1.0):
        replays += 1
        unscaled = replay.run(scale=1.0, fp32=False)
        if backward and unscaled is None and not lockstep:
            return "loss_scale", replays
    replays += 1
    fp32 = replay.run(scale=1.0, fp32=True)
    if origin is None:
        return "", replays
    if backward and unscaled is None:
        return "loss_scale", replays
    return ("half_precision" if fp32 is None else "model"), replays


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _any_rank(flag: bool, lockstep: bool, device: torch.device) -> bool:
    """``flag`` on this rank, or, in lockstep, on any rank (one all-reduce of one number, on the model's device:
    NCCL reduces CUDA tensors only)."""
    if not lockstep:
        return flag
    value = torch.tensor([float(flag)], device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def _sharded(model: nn.Module) -> bool:
    """Whether the model's parameters are DTensors (FSDP2, tensor parallelism)."""
    return any(_is_dtensor(p) for p in model.parameters())


def _is_dtensor(tensor: Any) -> bool:
    return callable(getattr(tensor, "to_local", None)) and hasattr(tensor, "device_mesh")


def nonfinite_params(optimizer: Any, names: dict[int, str]) -> list[str]:
    """Names of ``optimizer``'s parameters whose gradients hold inf/NaN (one host sync). A sharded (DTensor)
    gradient is read on this rank's shard only, with no communication: the monitor merges the ranks' lists."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return []
    grads = [p.grad.to_local() if _is_dtensor(p.grad) else p.grad for p in params]
    device = grads[0].device
    flags = torch.stack([(~torch.isfinite(g.detach()).all()).to(device) for g in grads]).tolist()
    return [names.get(id(p), f"<unnamed {tuple(p.shape)}>") for p, bad in zip(params, flags) if bad]


class _Replay:
    """One micro-batch's forward and backward, run again with every side effect undone."""

    def __init__(self, skipped: SkippedStep, model: Any, micro: MicroBatch, accumulate: int) -> None:
        self.skipped, self.model, self.micro, self.accumulate = skipped, model, micro, accumulate
        self.device = _device_of(model)

    def run(self, scale: float, fp32: bool) -> Optional[Origin]:
        """Replay; the :class:`Origin` of the inf/NaN that reached the loss or the gradients, or ``None``."""
        trace = NonFiniteTrace(self.model, self.device)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _undone(self.model), _silenced_logging(self.model):
            torch.set_rng_state(self.micro.cpu_rng)
            if self.micro.cuda_rng is not None:
                torch.cuda.set_rng_state(self.micro.cuda_rng, self.device)
            weights = _fp32_weights(self.model, self.skipped) if fp32 else _own_weights(self.model)
            with torch.enable_grad(), weights as params, trace:
                with _precision_context(self.skipped, fp32):
                    output = self.model.training_step(self.micro.batch, self.micro.batch_idx)
                loss = _loss_of(output)
                if loss is None:
                    return None
                origin = trace.origin([loss])  # a non-finite loss: the forward explains it, no backward needed
                if origin is not None:
                    return origin
                if params and loss.requires_grad:
                    scaled = loss.float() / self.accumulate * scale  # what the closure's backward started from
                    trace.phase = "backward"
                    grads = torch.autograd.grad(scaled, params, allow_unused=True)
                    return trace.origin([grad for grad in grads if grad is not None])
        return None


def _device_of(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _loss_of(output: Any) -> Optional[Tensor]:
    if isinstance(output, dict):
        output = output.get("loss")
    return output if isinstance(output, Tensor) else None


def _precision_context(skipped: SkippedStep, fp32: bool) -> contextlib.AbstractContextManager[None]:
    if fp32:
        return torch.autocast(skipped.device_type, enabled=False)
    return skipped.forward_context()


@contextlib.contextmanager
def _own_weights(model: nn.Module) -> Iterator[list[Tensor]]:
    """The model's trainable parameters, as they are (the gradients of the replay are taken with respect to them)."""
    yield [p for p in model.parameters() if p.requires_grad]


@contextlib.contextmanager
def _fp32_weights(model: nn.Module, skipped: SkippedStep) -> Iterator[list[Tensor]]:
    """A half model (master weights) runs with its fp32 values; yields the tensors to differentiate.

    The fp32 masters are put in the modules' parameter slots (``module._parameters[name]``, a tied parameter in
    each of its slots) as fresh leaves that share the masters' storage, and half buffers are upcast in their slots.
    The model's own ``Parameter`` objects are left alone: changing their ``.data`` to another dtype would drop their
    gradient accumulators, and with them the hooks DDP registered there (DDP would then wait forever for those
    parameters, or call them unused, on the next step).
    """
    fp32 = {id(param): value.detach().requires_grad_(param.requires_grad) for param, value in skipped.fp32_weights()}
    slots: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and id(param) in fp32:
                    slots.append((module._parameters, name, param))
                    # a plain fp32 leaf in the Parameter's slot, on purpose (see above); put back in `finally`
                    module._parameters[name] = fp32[id(param)]  # type: ignore[assignment]
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.dtype in (torch.float16, torch.bfloat16):
                    slots.append((module._buffers, name, buffer))
                    module._buffers[name] = buffer.float()
        yield [p for p in model.parameters() if p.requires_grad]  # the fp32 leaves now fill the slots
    finally:
        for table, name, value in reversed(slots):
            table[name] = value


@contextlib.contextmanager
def _undone(model: nn.Module) -> Iterator[None]:
    """Module buffers (BatchNorm statistics, counters) and torchmetrics states are put back afterwards."""
    buffers = [
        (module, name, buffer.clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
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
