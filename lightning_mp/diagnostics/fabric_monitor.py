"""``FabricPrecisionMonitor``: what :class:`~lightning_mp.PrecisionMonitor` does for a Trainer, in a Fabric loop.

A Fabric callback (``L.Fabric(callbacks=[monitor])``). Fabric calls ``on_after_setup`` after ``fabric.setup`` and
``on_after_optimizer_step`` after each ``optimizer.step()`` by itself; the loop adds two lines::

    monitor = FabricPrecisionMonitor(loss_fn=lambda model, batch: ..., log_dir="runs/1")
    fabric = L.Fabric(plugins=[plugin], callbacks=[monitor])
    model, optimizer = fabric.setup(model, optimizer)
    for index, batch in enumerate(loader):
        fabric.call("on_train_batch_start", batch=batch, batch_idx=index)   # remembered for a replay
        loss = loss_fn(model, batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.call("on_train_end")                                              # the report

``loss_fn(model, batch)`` is how the loop computes the loss: a skipped step is replayed with it (on the module inside
Fabric's wrapper, under the plugin's forward context) to find the module, phase and op where the inf/NaN was born
(:mod:`lightning_mp.diagnostics.overflow`). Every ``sample_every`` optimizer steps the unscaled gradients are
sampled after the step (before ``zero_grad``). The history, the overflow records and the report are the Trainer
monitor's (``monitor.history``; ``precision_diagnostics.json``, ``precision_report.md`` in ``log_dir`` on rank 0).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mp.diagnostics.history import LayerSample, OverflowRecord, RunHistory
from lightning_mp.diagnostics.monitor import (
    REPORT_SCALER_KEYS,
    PrecisionMonitor,
    merged_across_ranks,
    with_skips_in_backward,
)
from lightning_mp.diagnostics.overflow import nonfinite_params
from lightning_mp.diagnostics.skipped import SkipSource
from lightning_mp.diagnostics.underflow import (
    grouped_stats,
    names_of_params,
    param_groups_grads,
    read_rows,
    reduce_rows,
    scale_tensor,
)


class _FabricStep(nn.Module):
    """What the overflow replay calls a LightningModule: the user's module (its modules and parameters, named as
    the user's) with ``training_step(batch, index) = loss_fn(module, batch)``."""

    _inner: nn.Module
    _loss_fn: Callable[[nn.Module, Any], Any]

    def __init__(self, inner: nn.Module, loss_fn: Callable[[nn.Module, Any], Any]) -> None:
        super().__init__()
        object.__setattr__(self, "_inner", inner)  # not a submodule: names stay the user's
        object.__setattr__(self, "_loss_fn", loss_fn)
        self.automatic_optimization = True
        self.trainer = SimpleNamespace(accumulate_grad_batches=1)

    def named_modules(self, *args: Any, **kwargs: Any) -> Any:  # modules() and parameters() go through here
        return self._inner.named_modules(*args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return self._loss_fn(self._inner, batch)


class FabricPrecisionMonitor:
    """:class:`~lightning_mp.PrecisionMonitor` for a Fabric loop (see the module docstring).

    Args:
        loss_fn: ``loss_fn(model, batch) -> loss``, as the loop computes it: used to replay a skipped step.
        log_dir: where rank 0 writes the report (default ``"."``: the working directory, where the report goes into
            ``precision_reports/``; a later run's files get ``_1``, ``_2``, ... and never overwrite an earlier one).
        monitor_options: :class:`~lightning_mp.PrecisionMonitor`'s ``localise_overflows``, ``sample_every``,
            ``log_top``, ``report`` (validated there).
    """

    def __init__(
        self, loss_fn: Callable[[nn.Module, Any], Any], log_dir: Union[str, Path] = ".", **monitor_options: Any
    ) -> None:
        self.monitor = PrecisionMonitor(**monitor_options)
        self.loss_fn = loss_fn
        self.log_dir = Path(log_dir)
        self._suffix: Optional[str] = None
        self.step = 0
        self.report_files: Any = None
        self._plugin: Optional[object] = None  # Fabric's precision plugin (any: read by duck typing)
        self._step_module: Optional[_FabricStep] = None
        self._device = torch.device("cpu")
        self._rank_zero = True
        self._sampling = False
        self._bucket = -1

    @property
    def history(self) -> RunHistory:
        return self.monitor.history

    # ------------------------------------------------------------------ Fabric's hooks
    def on_after_setup(self, fabric: Any, module: Any) -> None:
        """Fabric calls this after ``fabric.setup`` / ``setup_module``."""
        plugin = fabric.strategy.precision
        inner = getattr(module, "module", module)  # the user's module inside Fabric's (and DDP's) wrappers
        monitor = self.monitor
        dtype = getattr(plugin, "dtype", torch.float32)
        precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "fp32")
        monitor.begin(precision, names_of_params(inner, getattr(plugin, "masters", None)))
        scaler = getattr(plugin, "scaler", None)
        if scaler is not None:
            state = scaler.state_dict()
            monitor.history.scaler = {key: state[key] for key in REPORT_SCALER_KEYS if key in state}
        observers = getattr(plugin, "skip_observers", None)
        if monitor.localise_overflows and isinstance(observers, list) and self._on_skip not in observers:
            observers.append(self._on_skip)
        self._plugin, self._step_module = plugin, _FabricStep(inner, self.loss_fn)
        self._device, self._rank_zero = fabric.device, fabric.is_global_zero

    def on_train_batch_start(self, batch: Any, batch_idx: int = 0) -> None:
        """Call it through ``fabric.call("on_train_batch_start", batch=batch, batch_idx=index)``."""
        scaler = getattr(self._plugin, "scaler", None)
        if scaler is not None and not scaler.check_only:
            self.history.record_scale(self.step, float(scaler.scale))
        if self._plugin is not None and self.monitor.localise_overflows:
            self.monitor.remember_batch(batch, batch_idx, self._device)
        every = self.monitor.every  # sample_every=None: 100 (a Fabric loop's length is not known here)
        self._sampling = bool(every) and self.step // every != self._bucket

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """Fabric calls this after each ``optimizer.step()``: sample (before ``zero_grad``), count the step."""
        self.history.steps += 1
        self.monitor.step_decided()
        if self._sampling:
            self._bucket = self.step // self.monitor.every
            self._sample(optimizer)
            self._sampling = False
        scaler = getattr(self._plugin, "scaler", None)
        if scaler is not None:
            self.monitor.fill_scale_after(float(scaler.scale))
        self.step += 1

    def on_train_end(self) -> None:
        """Call it through ``fabric.call("on_train_end")``: the report (rank 0), and the plugin let go."""
        observers = getattr(self._plugin, "skip_observers", [])
        if self._on_skip in observers:
            observers.remove(self._on_skip)
        if self.monitor.write_report and self._rank_zero:
            from lightning_mp.diagnostics.run_report import free_suffix, report_directory, write_run

            directory = report_directory(self.log_dir)  # never loose in the working directory
            if self._suffix is None:  # once per run: a second call replaces this run's files only
                self._suffix = free_suffix(directory)
            self.report_files = write_run(self.history, directory, self._suffix)

    # ------------------------------------------------------------------ what they do
    def _sample(self, optimizer: Any) -> None:
        scaler = getattr(self._plugin, "scaler", None)
        names = self.monitor.param_names
        layers, rows = grouped_stats(param_groups_grads(optimizer, names), scale_tensor(scaler))
        if not layers:  # no gradient to sample (optimizer_in_backward=True frees them inside backward)
            return
        (param_rows,) = read_rows(reduce_rows(rows))  # one sync
        scale = float(scaler.scale) if scaler is not None and not scaler.check_only else 1.0
        self.history.samples.append(LayerSample(self.step, scale, "param_grads", layers, param_rows))

    def _on_skip(self, plugin: SkipSource, optimizer: Any, model: Any) -> None:
        """The plugin calls this on a skipped step, before the scaler updates."""
        skipped = plugin.skipped_step()
        self.history.skipped.append(self.step)
        self.monitor.fill_scale_after(skipped.scale)
        names = self.monitor.param_names
        try:
            record = self.monitor.localise(skipped, optimizer, self._step_module, self.step)
        except Exception as error:  # a diagnostic must not end the run: the failure is reported, not hidden
            record = OverflowRecord(
                step=self.step,
                scale_before=skipped.scale,
                cause="failed",
                note=repr(error),
                nonfinite_params=nonfinite_params(optimizer, names),
            )
        self.history.overflows.append(merged_across_ranks(with_skips_in_backward(record, skipped)))
