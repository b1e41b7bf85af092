"""The run report: ``precision_report.md`` (summary, advice with its evidence, where skipped steps overflowed, the
worst layers) and ``precision_report.png`` (see :mod:`lightning_mp.diagnostics.plots`), written next to the run's
logs by :class:`~lightning_mp.PrecisionMonitor` after ``fit``, or on demand by :func:`report`.
"""

from __future__ import annotations

import math
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from lightning_mp.diagnostics.advice import advise
from lightning_mp.diagnostics.history import CAUSES, HISTORY_FILE, LayerSample, RunHistory, format_scale
from lightning_mp.fp8.stats import fp8_section

MARKDOWN_FILE = "precision_report.md"
PNG_FILE = "precision_report.png"
#: rows of the per-step overflow table and of the worst-layers table
MAX_ROWS = 30
WORST_LAYERS = 10
#: the error that ended a run is wrapped at spaces to lines of at most this many characters (a longer word stays whole)
ERROR_WIDTH = 100


@dataclass(frozen=True)
class ReportFiles:
    """What :func:`report` wrote: the Markdown, and the PNG (``None`` when it could not be drawn: ``png_error``)."""

    markdown: Path
    png: Optional[Path]
    png_error: str = ""


def report(path_or_trainer: Union[str, Path, Any], out_dir: Union[str, Path, None] = None) -> ReportFiles:
    """Write the precision report of a run.

    Args:
        path_or_trainer: a run's log directory (holding ``precision_diagnostics.json``), that file, or a ``Trainer``
            that ran with a :class:`~lightning_mp.PrecisionMonitor`.
        out_dir: where to write ``precision_report.md`` and ``.png`` (default: next to the history).
    """
    if isinstance(path_or_trainer, (str, Path)):
        path = Path(path_or_trainer)
        history = RunHistory.load(path)
        directory = path if path.is_dir() else path.parent
    else:
        history, directory = _from_trainer(path_or_trainer)
    return write_report(history, Path(out_dir) if out_dir is not None else directory)


def _from_trainer(trainer: Any) -> tuple[RunHistory, Path]:
    # a PrecisionMonitor, known by what it keeps (its history and log directory): the report does not import the
    # callback that writes it
    callbacks = getattr(trainer, "callbacks", [])
    monitors = [c for c in callbacks if isinstance(getattr(c, "history", None), RunHistory) and hasattr(c, "log_dir")]
    if monitors and monitors[0].log_dir is not None:
        return monitors[0].history, monitors[0].log_dir
    directory = Path(trainer.log_dir or trainer.default_root_dir)
    if (directory / HISTORY_FILE).is_file():
        return RunHistory.load(directory), directory
    raise ValueError(
        f"This Trainer has no PrecisionMonitor that ran fit, and {directory / HISTORY_FILE} does not exist: add "
        "lightning_mp.PrecisionMonitor() to Trainer(callbacks=...) and fit, or pass the log directory of such a run."
    )


#: where reports go when the run's log directory is the working directory (they never land loose there)
REPORTS_DIR = "precision_reports"


def report_directory(*candidates: Union[str, Path, None]) -> Path:
    """The first of ``candidates`` (the run's log directory, then its root directory) that is not the working
    directory; when each is (``logger=False`` without ``default_root_dir``, or a logger writing to ``os.getcwd()``
    as scvi-tools' does), ``./precision_reports``."""
    cwd = Path.cwd().resolve()
    for candidate in candidates:
        if candidate and Path(candidate).resolve() != cwd:
            return Path(candidate)
    return cwd / REPORTS_DIR


def free_suffix(directory: Path) -> str:
    """``""`` when ``directory`` holds no earlier report, else ``"_1"``, ``"_2"``, ...: the first suffix for which
    none of ``precision_diagnostics{suffix}.json``, ``precision_report{suffix}.md`` and ``.png`` exists, so a run
    never overwrites an earlier run's report."""
    index = 0
    while True:
        suffix = f"_{index}" if index else ""
        names = (HISTORY_FILE, MARKDOWN_FILE, PNG_FILE)
        if not any((directory / name.replace(".", f"{suffix}.", 1)).exists() for name in names):
            return suffix
        index += 1


def write_run(history: RunHistory, directory: Path, suffix: str) -> ReportFiles:
    """Save ``history`` and write its report into ``directory``, every file name ending in ``suffix``."""
    history.save(directory, suffix)
    return write_report(history, directory, suffix)


def write_report(history: RunHistory, directory: Path, suffix: str = "") -> ReportFiles:
    """Write the Markdown (always) and the PNG (when matplotlib is installed) into ``directory``, as
    ``precision_report{suffix}.md`` and ``.png``."""
    directory.mkdir(parents=True, exist_ok=True)
    png_path = directory / PNG_FILE.replace(".", f"{suffix}.", 1)
    png: Optional[Path] = png_path
    png_error = ""
    try:
        from lightning_mp.diagnostics.plots import plot_history

        plot_history(history, png_path)
    except ImportError as error:
        png, png_error = None, str(error)
    markdown = directory / MARKDOWN_FILE.replace(".", f"{suffix}.", 1)
    markdown.write_text(render_markdown(history, png_error, png_name=PNG_FILE.replace(".", f"{suffix}.", 1)))
    return ReportFiles(markdown, png, png_error)


def render_markdown(history: RunHistory, png_error: str = "", png_name: str = PNG_FILE) -> str:
    lines = ["# Mixed-precision report", "", _summary(history), ""]
    if history.error:
        lines += ["**The run ended with an error:**", "", *_fenced(error_lines(history.error)), ""]
    lines += [
        f"![loss scale and per-layer gradient statistics]({png_name})"
        if not png_error
        else f"(No figure: {png_error})",
        "",
    ]
    lines += ["## Advice", ""]
    advice = advise(history)
    if not advice and history.error:
        lines += ["No rule covers the error that ended this run (above): fix it first, then read a new report.", ""]
    elif not advice:
        lines += [
            "Nothing to change: no rule found its symptom in this run (see "
            "`lightning_mp/diagnostics/advice.py` for the rules and thresholds).",
            "",
        ]
    if len(advice) > 1:
        lines += [
            "Apply the first item, run again and read the new report: later items may be consequences of "
            "earlier ones (an overflowing module keeps pushing the scale down).",
            "",
        ]
    for number, item in enumerate(advice, 1):
        lines += [f"{number}. **{item.rule}**: `{item.change}`", f"   - Evidence: {item.evidence}", ""]
    lines += _overflow_section(history) + _layers_section(history) + fp8_section(history) + _legend()
    return "\n".join(lines) + "\n"


def error_lines(error: str, width: int = ERROR_WIDTH) -> list[str]:
    """The whole of ``error``, each of its lines wrapped at spaces to ``width`` characters, the continuations indented
    by two spaces: never cut (a word longer than ``width``, a path or a policy line, stays whole on its own line)."""
    wrapped = []
    for line in error.splitlines() or [""]:
        wrapped += textwrap.wrap(
            line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False
        ) or [""]
    return wrapped


def _fenced(lines: list[str]) -> list[str]:
    """``lines`` as a Markdown code block, its fence longer than any run of backticks inside (shown as written)."""
    longest = max((len(run) for line in lines for run in re.findall("`+", line)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"{fence}text", *lines, fence]


def _summary(history: RunHistory) -> str:
    skipped = len(history.skipped)
    share = f" ({skipped / history.steps:.1%})" if history.steps else ""
    text = f"{history.precision} run: {history.steps} optimizer steps, {skipped} skipped{share}."
    if history.scale_changes:
        first, final = history.scale_changes[0][1], history.scale_changes[-1][1]
        lowest = min(scale for _, scale in history.scale_changes)
        text += (
            f" Loss scale {format_scale(first)} at the start, {format_scale(final)} at the end (lowest "
            f"{format_scale(lowest)})."
        )
    if history.scaler and not history.scaler.get("check_only"):
        settings = ("growth_interval", "hysteresis", "backoff_factor", "growth_factor", "min_scale", "max_scale")
        text += " Scaler: " + ", ".join(_setting(key, history.scaler[key]) for key in settings if key in history.scaler)
        text += "" if history.scaler.get("dynamic", True) else " (static)"
        text += "."
    if history.sample_every:
        text += (
            f" Gradient statistics sampled every {history.sample_every} optimizer steps "
            f"({len(history.samples_of('param_grads'))} samples)."
        )
    return text


def _setting(key: str, value: Any) -> str:
    if key in ("min_scale", "max_scale"):
        return f"{key}={format_scale(value)}"
    return f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"


def _overflow_section(history: RunHistory) -> list[str]:
    lines = ["## Where the skipped steps overflowed", ""]
    if not history.skipped:
        return lines + ["No optimizer step was skipped.", ""]
    if not history.overflows:
        return lines + [
            f"{len(history.skipped)} steps were skipped (steps {history.skipped[:20]}); overflow "
            "localisation was off (`PrecisionMonitor(localise_overflows=True)` turns it on).",
            "",
        ]
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for record in history.overflows:
        key = (record.where(), record.cause, record.module_class if record.located else "")
        groups.setdefault(key, []).append(record)
    lines += [
        "| where the inf/NaN was born | cause | skipped steps | first | last | largest finite input |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for (where, cause, _), records in sorted(groups.items(), key=lambda item: -len(item[1])):
        amax = max((r.input_amax for r in records if r.input_amax is not None), default=None)
        lines.append(
            f"| {where} | {cause} | {len(records)} | {records[0].step} | {records[-1].step} | "
            f"{'-' if amax is None else f'{amax:.4g}'} |"
        )
    lines += [
        "",
        "Every skipped step:",
        "",
        "| step | scale before -> after | where | cause | non-finite gradients | replays | seconds |",
        "|---:|---|---|---|---|---:|---:|",
    ]
    for record in history.overflows[:MAX_ROWS]:
        params = ", ".join(record.nonfinite_params[:3]) + (" ..." if len(record.nonfinite_params) > 3 else "")
        after = "-" if record.scale_after is None else format_scale(record.scale_after)
        lines.append(
            f"| {record.step} | {format_scale(record.scale_before)} -> {after} | {record.where()} | "
            f"{record.cause} | "
            f"{params or '-'} | {record.replays} | {record.seconds:.3f} |"
        )
    if len(history.overflows) > MAX_ROWS:
        lines.append(f"| ... | | {len(history.overflows) - MAX_ROWS} more in {HISTORY_FILE} | | | | |")
    costs = [r.seconds for r in history.overflows]
    lines += ["", f"Localisation cost: {sum(costs):.2f} s in all, {max(costs):.3f} s at most for one skipped step.", ""]
    return lines


def _layers_section(history: RunHistory) -> list[str]:
    samples = history.samples_of("param_grads")
    lines = ["## Gradient underflow and headroom per layer", ""]
    if not samples:
        return lines + ["No samples (`PrecisionMonitor(sample_every=N)` with N > 0 takes them).", ""]
    last = samples[-1]
    if history.precision == "fp16":
        lines += [
            f"At the last sample (step {last.step}, scale {format_scale(last.scale)}), {_which(last)} with the "
            "largest share of values below fp16's normal range after scaling:",
            "",
        ]
    else:  # no loss scale, and a range as wide as fp32's: zeros are what is left to see
        lines += [
            f"At the last sample (step {last.step}, {history.precision}), {_which(last)} with the "
            "largest share of zero gradient values:",
            "",
        ]
    lines += _layer_table(last, history.precision)
    activations = history.samples_of("activation_grads")
    if activations:
        lines += [
            "",
            f"Activation gradients (leaf module outputs, as autograd held them) at step {activations[-1].step}:",
            "",
        ] + _layer_table(activations[-1], history.precision)
    return lines + [""]


def _which(sample: LayerSample) -> str:
    """The header's count, from the rows :func:`_layer_table` writes: ``the 10 of 52 layers``, ``the 9 layers``."""
    shown, total = min(WORST_LAYERS, len(sample.layers)), len(sample.layers)
    noun = "layer" if total == 1 else "layers"
    return f"the {shown} of {total} {noun}" if shown < total else f"the {total} {noun}" if total > 1 else "the layer"


def _layer_table(sample: LayerSample, precision: str) -> list[str]:
    shares, zeros, headroom = sample.underflow_share(), sample.zero_share(), sample.headroom()
    flush, subnormal, numel = sample.column("flush"), sample.column("subnormal"), sample.column("numel")
    order = sorted(range(len(sample.layers)), key=lambda i: (-shares[i], -zeros[i]))[:WORST_LAYERS]
    if precision != "fp16":
        return ["| layer | values | zeros | largest magnitude |", "|---|---:|---:|---:|"] + [
            f"| {sample.layers[i] or '(root)'} | {numel[i]:.0f} | {zeros[i]:.2%} | {sample.column('amax')[i]:.3g} |"
            for i in order
        ]
    rows = [
        "| layer | values | zeros | flush to zero | subnormal | largest scaled | headroom (powers of 2) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i in order:
        room = headroom[i]
        text = "-" if room is None else ("overflow" if room == -math.inf else f"{room:.1f}")
        count = numel[i] or 1.0
        rows.append(
            f"| {sample.layers[i] or '(root)'} | {numel[i]:.0f} | {zeros[i]:.2%} | {flush[i] / count:.2%} | "
            f"{subnormal[i] / count:.2%} | {sample.column('amax')[i]:.3g} | {text} |"
        )
    return rows


def _legend() -> list[str]:
    lines = ["## Causes", ""]
    lines += [f"- `{cause}`: {text}" for cause, text in CAUSES.items()]
    return lines
