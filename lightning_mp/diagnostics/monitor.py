"""``PrecisionMonitor``: loss scale, skipped steps and learning rate in the progress bar and the logger; where each
skipped step overflowed; sampled per-layer underflow and headroom of the gradients; a report after ``fit``.

Cost on a step that is neither skipped nor sampled: no host synchronisation and no hooks (a reference to the batch
and a host copy of the RNG state are kept for the overflow replay). A sampled step costs a few kernels per gradient
tensor and one host sync; a skipped step costs its replay (see :mod:`lightning_mp.diagnostics.overflow`).

The loss scale the statistics divide by is read from :class:`~lightning_mp.DynamicLossScaler` on the device. With
another precision plugin (Lightning's built-in ``16-mixed`` and its ``GradScaler``) there is no scale to read
without a sync, so the statistics are taken at scale 1, and skipped steps are neither seen nor localised.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mp.diagnostics.half_failure import HalfPrecisionError
from lightning_mp.diagnostics.history import LayerSample, OverflowRecord, RunHistory
from lightning_mp.diagnostics.overflow import OverflowLocaliser, nonfinite_params
from lightning_mp.diagnostics.run_report import free_suffix, report_directory, write_run
from lightning_mp.diagnostics.skipped import SkippedStep, SkipSource
from lightning_mp.diagnostics.underflow import (
    ActivationGradStats,
    grouped_stats,
    names_of_params,
    param_groups_grads,
    read_rows,
    reduce_rows,
    scale_tensor,
)
from lightning_mp.fp8.stats import Fp8Sampler, sample_record
from lightning_mp.scaler.settings import SETTING_NAMES

#: ``sample_every=None``: sample every this many optimizer steps, lowered so a run of known length gets MIN_SAMPLES
DEFAULT_SAMPLE_EVERY = 100
MIN_SAMPLES = 5
#: the scaler state the report shows: the scale and the settings (the counters come from the run itself)
REPORT_SCALER_KEYS = ("scale", *(name for name in SETTING_NAMES if name != "enabled"))


class PrecisionMonitor(L.Callback):
    """Watches a mixed-precision run; works with :class:`~lightning_mp.MixedPrecisionPlugin` (fp16 or bf16, master
    weights, manual optimization) and, for the learning rate and the gradient statistics, with any precision.

    Args:
        prog_bar: show ``loss_scale`` and ``skipped_steps`` in the progress bar (default ``True``); both, and ``lr``,
            go to the logger whenever it writes (``log_every_n_steps``); the progress bar's values are updated
            whenever they change. ``loss_scale`` only when the run scales the loss (not in bf16).
        localise_overflows: on every skipped step, replay it to find the module and operation where the inf/NaN was
            born, forward or backward, and whether the loss scale, half precision or the model caused it (default
            ``True``; costs nothing on other steps).
        sample_every: every this many optimizer steps, per-layer gradient statistics: zeros, values that are fp16
            subnormals or flush to zero after scaling, the largest magnitude and the headroom before fp16's 65504
            (``0`` turns sampling off). One host sync per sampled step. Default ``None``: every 100 steps, or every
            ``steps // 5`` in a run shorter than 500 optimizer steps (``trainer.estimated_stepping_batches``), so
            that a short run gets at least five samples. A number is taken as given.
        activation_grads: on sampled steps, the same statistics for the gradients of every leaf module's output
            (default ``False``: it hooks every leaf module during the sampled step's backward).
        log_top: how many of the worst layers / most overflowing modules are logged as scalars (default ``5``).
        report: after ``fit`` (or when it fails), rank 0 writes ``precision_diagnostics.json``, ``precision_report.md``
            and ``precision_report.png`` into the run's log directory (default ``True``): ``trainer.log_dir``, or
            ``default_root_dir`` when that is the working directory, or ``./precision_reports`` when both are. A
            directory that holds an earlier run's report gets ``precision_report_1.md`` (``_2``, ...): nothing is
            overwritten. See :func:`lightning_mp.diagnostics.report`.
    """

    def __init__(
        self,
        prog_bar: bool = True,
        localise_overflows: bool = True,
        sample_every: Optional[int] = None,
        activation_grads: bool = False,
        log_top: int = 5,
        report: bool = True,
    ) -> None:
        for name, value in (
            ("prog_bar", prog_bar),
            ("localise_overflows", localise_overflows),
            ("activation_grads", activation_grads),
            ("report", report),
        ):
            if not isinstance(value, bool):
                raise ValueError(f"PrecisionMonitor({name}={value!r}): must be True or False.")
        for name, number in (("sample_every", 0 if sample_every is None else sample_every), ("log_top", log_top)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise ValueError(f"PrecisionMonitor({name}={number!r}): must be an integer >= 0 (0 turns it off).")
        self.prog_bar = prog_bar
        self.localise_overflows = localise_overflows
        self.sample_every = sample_every
        self.activation_grads = activation_grads
        self.log_top = log_top
        self.write_report = report
        self.history = RunHistory()
        self.log_dir: Optional[Path] = None
        self.report_files: Any = None  # the ReportFiles written after fit (rank 0), for the CLI's summary
        self._localiser = OverflowLocaliser()
        self._activations = ActivationGradStats()
        self._fp8 = Fp8Sampler()  # --- fp8 casts of converted layers, on sampled steps (lightning_mp.fp8.stats)
        self._names: dict[int, str] = {}
        self._observers: Optional[list[Callable[..., None]]] = None  # the plugin's skip_observers, while in them
        self._sampling = False
        self._sampled_bucket = -1
        self._overflow_counts: dict[str, int] = {}
        self._last_logged: dict[str, float] = {}
        self._suffix: Optional[str] = None  # the report's file suffix in log_dir, chosen at the first write of a fit
        self._every = DEFAULT_SAMPLE_EVERY if sample_every is None else sample_every  # None: set at on_train_start

    # ------------------------------------------------------------------ setup and teardown
    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plugin = trainer.precision_plugin
        self._every = DEFAULT_SAMPLE_EVERY if self.sample_every is None else self.sample_every
        self.history = RunHistory(precision=_precision_of(trainer), sample_every=self._every)
        self.history.fp8_recipe = getattr(getattr(plugin, "fp8", None), "recipe", "")
        self._overflow_counts, self._sampled_bucket, self._sampling, self._last_logged = {}, -1, False, {}
        self._suffix = None
        self._localiser.forget()
        if self._every and getattr(plugin, "optimizer_in_backward", False):
            rank_zero_warn(
                "PrecisionMonitor: with optimizer_in_backward=True each parameter's gradient is freed inside backward, "
                "so the per-layer gradient statistics (sample_every) find none; activation_grads=True still samples "
                "the activation gradients. Skipped updates are recorded and localised as usual."
            )
        observers = getattr(plugin, "skip_observers", None)
        if self.localise_overflows and isinstance(observers, list) and self._on_skip not in observers:
            observers.append(self._on_skip)
            self._observers = observers

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after the plugin connected (masters exist); log_dir broadcasts, so every rank asks here, together
        self._names = names_of_params(pl_module, getattr(trainer.precision_plugin, "masters", None))
        self.log_dir = report_directory(trainer.log_dir, trainer.default_root_dir)
        scaler = _our_scaler(trainer)
        if scaler is not None:
            state = scaler.state_dict()
            self.history.scaler = {key: state[key] for key in REPORT_SCALER_KEYS}

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # sample_every=None: a run of fewer than MIN_SAMPLES * 100 optimizer steps samples every total // MIN_SAMPLES
        if self.sample_every is None:
            self._every = sampling_interval(DEFAULT_SAMPLE_EVERY, trainer.estimated_stepping_batches)
            self.history.sample_every = self._every

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._activations.disarm()
        self._fp8.disarm()
        self._localiser.forget()
        if self._observers is not None and self._on_skip in self._observers:
            self._observers.remove(self._on_skip)
        self._observers = None

    # ------------------------------------------------------------------ every step
    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        scaler = _our_scaler(trainer)
        if scaler is not None and not scaler.check_only:  # bf16's check-only scaler has no scale to follow
            self.history.record_scale(trainer.global_step, float(scaler.scale))
        if self._observers is not None and pl_module.automatic_optimization:  # manual: nothing is replayed
            self._localiser.remember(batch, batch_idx, pl_module.device)
        if self._every:
            self._sampling = trainer.global_step // self._every != self._sampled_bucket
            if self._sampling and self.activation_grads:
                self._activations.arm(pl_module)
            if self._sampling:
                self._fp8.arm(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.history.steps += 1
        self._localiser.step_decided()
        if self._sampling:
            self._sampled_bucket = trainer.global_step // self._every
            self._sample(trainer, optimizer)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._activations.disarm()
        self._fp8.disarm()
        self._sampling = False
        scaler = _our_scaler(trainer)
        values: dict[str, tuple[float, bool]] = {}
        if scaler is not None:
            self.fill_scale_after(float(scaler.scale))
            if not scaler.check_only:  # bf16 checks for inf/NaN but scales nothing: no loss_scale to show
                values["loss_scale"] = (float(scaler.scale), self.prog_bar)
            values["skipped_steps"] = (float(scaler.skipped_steps), self.prog_bar)
        for index, optimizer in enumerate(trainer.optimizers):
            values["lr" if index == 0 else f"lr-{index}"] = (float(optimizer.param_groups[0]["lr"]), False)
        # self.log costs ~0.2 ms a call: log a value when the logger writes this step (Lightning's own monitors ask
        # the same private property), or, for a progress-bar value, when it changed (the bar keeps the last value it
        # was given). The lr changes every step under most schedulers and only the logger shows it: logged when due
        # (and on the first step, so that callback_metrics has it). CPU tensors: no device copy, and reading them
        # for the progress bar does not wait for the device
        due = getattr(getattr(trainer, "_logger_connector", None), "should_update_logs", True)
        for name, (value, prog_bar) in values.items():
            last = self._last_logged.get(name)
            if due or last is None or (prog_bar and last != value):
                pl_module.log(name, torch.tensor(value), prog_bar=prog_bar, on_step=True, on_epoch=False)
                self._last_logged[name] = value

    # ------------------------------------------------------------------ sampled statistics
    def _sample(self, trainer: L.Trainer, optimizer: Any) -> None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        layers, rows = grouped_stats(param_groups_grads(optimizer, self._names), scale_tensor(_our_scaler(trainer)))
        act_layers, act_rows = self._activations.take()
        fp8_layers, fp8_rows = self._fp8.take()
        param_rows, activation_rows, fp8_read = read_rows(reduce_rows(rows), reduce_rows(act_rows), fp8_rows)  # 1 sync
        if fp8_layers:
            self.history.fp8_samples.append(sample_record(trainer.global_step, fp8_layers, fp8_read))
        scaler = _our_scaler(trainer)
        scale = float(scaler.scale) if scaler is not None and not scaler.check_only else 1.0
        step = trainer.global_step
        # no parameter gradient to sample (optimizer_in_backward=True frees them inside backward): no such sample
        samples = [LayerSample(step, scale, "param_grads", layers, param_rows)] if layers else []
        if act_layers:
            samples.append(LayerSample(step, 1.0, "activation_grads", act_layers, activation_rows))
        self.history.samples.extend(samples)
        if layers:
            self._log_sample(trainer, samples[0])

    def _log_sample(self, trainer: L.Trainer, sample: LayerSample) -> None:
        if not (trainer.is_global_zero and trainer.loggers and sample.layers):
            return
        metrics: dict[str, float] = {}
        if self.history.precision == "fp16":
            shares = sample.underflow_share()
            metrics["underflow_share/max"] = max(shares)
            for index in sorted(range(len(shares)), key=lambda i: -shares[i])[: self.log_top]:
                metrics[f"underflow_share/{sample.layers[index]}"] = shares[index]
            headroom = [h for h in sample.headroom() if h is not None]
            if headroom and min(headroom) > float("-inf"):
                metrics["headroom_bits/min"] = min(headroom)
        zeros = sample.zero_share()
        metrics["grad_zero_share/max"] = max(zeros)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=sample.step)

    # ------------------------------------------------------------------ skipped steps
    def _on_skip(self, plugin: SkipSource, optimizer: Any, model: Any) -> None:
        """Called by the plugin on a skipped step, before the scaler updates (see ``skip_observers``)."""
        skipped = plugin.skipped_step()
        trainer = model.trainer
        step = trainer.global_step
        self.history.skipped.append(step)
        self.fill_scale_after(skipped.scale)
        try:
            record = self._localiser.localise(skipped, optimizer, model, step, self._names)
        except Exception as error:  # a diagnostic must not end the run: the failure is reported, not hidden
            rank_zero_warn(f"PrecisionMonitor could not localise the overflow of step {step}: {error!r}")
            record = OverflowRecord(
                step=step,
                scale_before=skipped.scale,
                cause="failed",
                note=repr(error),
                nonfinite_params=nonfinite_params(optimizer, self._names),
            )
        record = merged_across_ranks(with_skips_in_backward(record, skipped))
        self.history.overflows.append(record)
        if record.located:
            self._overflow_counts[record.module] = self._overflow_counts.get(record.module, 0) + 1
            if trainer.is_global_zero and self.log_top:
                top = sorted(self._overflow_counts.items(), key=lambda item: -item[1])[: self.log_top]
                for logger in trainer.loggers:
                    logger.log_metrics(
                        {f"overflows/{name or '(training_step)'}": float(count) for name, count in top}, step=step
                    )

    def fill_scale_after(self, scale: float) -> None:
        """The scale after the latest skipped steps (``scale``, read after the scaler updated) into their records."""
        for record in reversed(self.history.overflows):
            if record.scale_after is not None:
                break
            record.scale_after = scale

    # ------------------------------------------------------------------ for a loop of its own (the Fabric monitor)
    @property
    def every(self) -> int:
        """The sampling interval in use, in optimizer steps (``0``: off): ``sample_every``, or its default."""
        return self._every

    @property
    def param_names(self) -> dict[int, str]:
        """``id(parameter) -> name`` for the run's parameters, as set at the start of a fit (or by :meth:`begin`)."""
        return self._names

    def begin(self, precision: str, names: dict[int, str]) -> None:
        """A fresh history for a run in ``precision`` (``"fp16"``, ``"bf16"``, ``"fp32"``) whose parameters are named
        by ``names``: what ``setup`` and ``on_fit_start`` do for a Trainer."""
        self.history = RunHistory(precision=precision, sample_every=self._every)
        self._names = names

    def remember_batch(self, batch: Any, batch_idx: int, device: torch.device) -> None:
        """Keep ``batch`` (a reference) and the RNG state, to replay the step if it is skipped (:meth:`localise`)."""
        self._localiser.remember(batch, batch_idx, device)

    def step_decided(self) -> None:
        """The optimizer step of the remembered batches ran (or was skipped): the next batch starts a new window."""
        self._localiser.step_decided()

    def localise(self, skipped: SkippedStep, optimizer: Any, model: Any, step: int) -> OverflowRecord:
        """Replay the remembered batches of skipped step ``step`` on ``model`` to find the module, phase and op where
        the inf/NaN was born (:class:`~lightning_mp.diagnostics.overflow.OverflowLocaliser`)."""
        return self._localiser.localise(skipped, optimizer, model, step, self._names)

    # ------------------------------------------------------------------ the end of fit
    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._finish(trainer)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self.history.error = f"{type(exception).__name__}: {exception}"
        self.history.half_failure = half_failure_of(exception)
        self._finish(trainer)

    def _finish(self, trainer: L.Trainer) -> None:
        scaler = _our_scaler(trainer)
        if scaler is not None:
            self.fill_scale_after(float(scaler.scale))
        if not (self.write_report and trainer.is_global_zero and self.log_dir is not None):
            return
        if self._suffix is None:  # chosen once per fit: a second write of this run replaces its own files only
            self._suffix = free_suffix(self.log_dir)
        self.report_files = write_run(self.history, self.log_dir, self._suffix)


def sampling_interval(sample_every: int, total_steps: Union[int, float]) -> int:
    """``sample_every``, or less for a run too short to sample :data:`MIN_SAMPLES` times with it: then every
    ``total_steps // MIN_SAMPLES`` steps (at least 1). ``0`` stays off; an unknown length (inf) keeps it."""
    if not sample_every or not math.isfinite(total_steps) or total_steps >= MIN_SAMPLES * sample_every:
        return sample_every
    return max(1, int(total_steps) // MIN_SAMPLES)


def half_failure_of(exception: BaseException) -> dict[str, Any]:
    """What a :class:`~lightning_mp.diagnostics.half_failure.HalfPrecisionError` in ``exception``'s chain found
    (Lightning may wrap it), as a dict: its first failure, with the forward's other failures under ``"others"``;
    empty when there is none."""
    seen: Optional[BaseException] = exception
    while seen is not None:
        if isinstance(seen, HalfPrecisionError):
            return {**seen.failure.to_dict(), "others": [failure.to_dict() for failure in seen.failures[1:]]}
        seen = seen.__cause__ or seen.__context__
    return {}


def _our_scaler(trainer: L.Trainer) -> Any:
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and hasattr(scaler, "skipped_steps") and getattr(scaler, "enabled", True):
        return scaler
    return None


def _precision_of(trainer: L.Trainer) -> str:
    dtype = getattr(trainer.precision_plugin, "dtype", None)
    if dtype == torch.float16 or str(trainer.precision).startswith("16"):
        return "fp16"
    if dtype == torch.bfloat16 or str(trainer.precision).startswith("bf16"):
        return "bf16"
    return "fp32"


def with_skips_in_backward(record: OverflowRecord, skipped: SkippedStep) -> OverflowRecord:
    """``record`` naming the parameters whose update was skipped inside backward (``optimizer_in_backward=True``:
    their gradients are freed by then, so only the step's own report names them)."""
    if skipped.skipped_in_backward:
        record.nonfinite_params = list(skipped.skipped_in_backward)
        record.note = (record.note + "; " if record.note else "") + (
            "optimizer_in_backward: only these parameters' updates were skipped, every other one was applied"
        )
    return record


def merged_across_ranks(record: OverflowRecord) -> OverflowRecord:
    """Every rank skips the same step (the decision is agreed), but only the ranks whose micro-batch overflowed can
    reproduce it: gather every rank's record and keep the first that located the origin, naming the ranks that found
    the same place; otherwise rank 0's. Every rank ends with the same record. The non-finite gradients are the union
    of the ranks' lists (under FSDP2 each rank reads its own shards)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return record
    world = torch.distributed.get_world_size()
    if world < 2:
        return record
    records: list[Any] = [None] * world
    torch.distributed.all_gather_object(records, record)
    located = [(rank, r) for rank, r in enumerate(records) if r is not None and r.located]
    chosen = located[0][1] if located else records[0]
    chosen.ranks = [rank for rank, r in located if (r.module, r.phase) == (chosen.module, chosen.phase)]
    params = [name for r in records if r is not None for name in r.nonfinite_params]
    chosen.nonfinite_params = list(dict.fromkeys(params))
    return chosen
