"""The report's figure: the loss scale over optimizer steps with the skipped steps marked, and per-layer heatmaps of
the sampled gradient statistics over time (fp16: underflow share and headroom; bf16/fp32: share of zeros).

Needs matplotlib (``pip install "lightning_mp[diagnostics]"``); :func:`plot_history` raises ``ImportError`` with
that instruction when it is missing, and the report writes its Markdown without the figure.
"""

from __future__ import annotations

import math
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from lightning_mp.diagnostics.history import LayerSample, RunHistory
from lightning_mp.fp8.stats import CASTS
from lightning_mp.fp8.stats import shares as fp8_shares

#: at most this many layers are drawn in a heatmap (the ones with the largest values, kept in model order)
MAX_LAYERS = 40
#: layer names longer than this are shown by their tail on the heatmaps' axes
LABEL_CHARS = 40
#: where an overflowed layer (infinite amax) is drawn on the headroom scale
OVERFLOW_BITS = -1.0

CAUSE_COLOURS = {
    "loss_scale": "tab:orange",
    "half_precision": "tab:red",
    "model": "black",
    "not_reproduced": "tab:gray",
    "gradients_only": "tab:purple",
    "failed": "tab:gray",
}


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as error:
        raise ImportError(
            "The precision report's PNG needs matplotlib, which is not installed: pip install "
            '"lightning_mp[diagnostics]" (or pip install matplotlib). The Markdown report is written without it.'
        ) from error
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def plot_history(history: RunHistory, path: Path) -> Path:
    """Draw ``history`` into the PNG ``path``; returns ``path``."""
    plt = _matplotlib()
    samples = [s for s in history.samples_of("param_grads") if s.layers]  # a sample of no gradient: nothing to draw
    fp16 = history.precision == "fp16"
    fp8 = history.fp8_samples  # --- fp8 casts (lightning_mp.fp8.stats): one more heatmap
    panels = 1 + (2 if samples and fp16 else 1 if samples else 0) + (1 if fp8 else 0)
    heights = [2.2] + [3.2] * (panels - 1)
    figure, axes = plt.subplots(panels, 1, figsize=(11, sum(heights) + 0.8), height_ratios=heights, squeeze=False)
    axes = [row[0] for row in axes]
    _plot_scale(axes[0], history)
    if samples and fp16:
        shares = [[100 * v for v in s.underflow_share()] for s in samples]
        _heatmap(
            figure,
            axes[1],
            samples,
            shares,
            "% of gradient values below fp16's normal range after scaling (subnormal or flushed)",
            "magma_r",
            "underflow %",
            pick=max,
            low=0.0,
        )
        headroom = [[_finite_or(h, math.nan) for h in s.headroom()] for s in samples]
        _heatmap(
            figure,
            axes[2],
            samples,
            headroom,
            "headroom: powers of two between the largest scaled gradient and "
            f"65504 (red: overflow near; {OVERFLOW_BITS:g} = overflowed; blank: all zero)",
            "RdYlGn",
            "bits",
            pick=lambda v: -min(v),
            low=OVERFLOW_BITS,
        )
    elif samples:
        zeros = [[100 * v for v in s.zero_share()] for s in samples]
        _heatmap(
            figure,
            axes[1],
            samples,
            zeros,
            f"% of gradient values that are exactly zero ({history.precision})",
            "magma_r",
            "zeros %",
            pick=max,
            low=0.0,
        )
    if fp8:
        layers = [f"{layer} {cast}" for cast in CASTS for layer in fp8[-1]["layers"]]
        fp8_as = [LayerSample(r["step"], 1.0, "fp8", layers, []) for r in fp8]
        flushed = [[100 * v for cast in CASTS for v in fp8_shares(r, cast, "flush")] for r in fp8]
        _heatmap(
            figure,
            axes[-1],
            fp8_as,
            flushed,
            f"% of values flushed below fp8's smallest subnormal after "
            f"scaling, per fp8 layer and cast ({history.fp8_recipe})",
            "magma_r",
            "flushed %",
            pick=max,
            low=0.0,
        )
    figure.tight_layout()
    _fit_titles(figure, axes)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _fit_titles(figure: Any, axes: list[Any]) -> None:
    """Wrap each title that runs past the figure's edges (a long title above an axis narrowed by long layer names)
    onto as many lines as it needs, then lay the figure out again for the taller titles."""
    renderer = figure.canvas.get_renderer()
    wrapped = False
    for axis in axes:
        title = axis.title
        text = title.get_text()
        box = title.get_window_extent(renderer)
        axis_box = axis.get_window_extent(renderer)  # the title is centred over its axis
        room = min(figure.bbox.width, axis_box.width + 2 * min(axis_box.x0, figure.bbox.width - axis_box.x1))
        if box.width <= room or not text:
            continue
        chars = max(20, int(len(text) * room / box.width) - 2)
        title.set_text(textwrap.fill(text, chars))
        wrapped = True
    if wrapped:
        figure.tight_layout()


def _label(name: str, chars: int = LABEL_CHARS) -> str:
    """A layer's name for an axis, its tail kept when it is long (the end tells layers apart)."""
    return name if len(name) <= chars else "..." + name[-(chars - 3) :]


def _finite_or(value: Any, default: float) -> float:
    if value is None:
        return default
    return OVERFLOW_BITS if value == -math.inf else max(value, OVERFLOW_BITS)


def _plot_scale(axis: Any, history: RunHistory) -> None:
    last = max(history.steps - 1, history.scale_changes[-1][0] if history.scale_changes else 0, 0)
    if history.scale_changes:
        xs = [step for step, _ in history.scale_changes] + [last]
        ys = [scale for _, scale in history.scale_changes] + [history.scale_changes[-1][1]]
        axis.step(xs, ys, where="post", color="tab:blue", label="loss scale")
        axis.set_yscale("log", base=2)
    records = {record.step: record for record in history.overflows}
    for cause in CAUSE_COLOURS:
        steps = [s for s in history.skipped if (records[s].cause if s in records else "not_reproduced") == cause]
        if steps:
            ys = [history.scale_at(s) or 1.0 for s in steps]
            modules = Counter(
                records[s].module or records[s].module_class for s in steps if s in records and records[s].located
            )
            where = f", mostly {modules.most_common(1)[0][0]}" if modules else ""
            axis.scatter(
                steps,
                ys,
                marker="x",
                color=CAUSE_COLOURS[cause],
                s=40,
                zorder=3,
                label=f"skipped: {cause.replace('_', ' ')} ({len(steps)}{where})",
            )
    title = f"loss scale over optimizer steps ({history.precision}, {len(history.skipped)} of {history.steps} skipped)"
    if not history.scale_changes:
        title = (
            f"skipped optimizer steps ({history.precision}, no loss scale: {len(history.skipped)} of {history.steps})"
        )
        axis.set_yticks([])
    axis.set_title(title, fontsize=10)
    axis.set_xlabel("optimizer step")
    axis.set_xlim(-0.5, last + 0.5)
    axis.grid(alpha=0.3)
    if history.skipped or history.scale_changes:
        axis.legend(fontsize=8, loc="best")


def _heatmap(
    figure: Any,
    axis: Any,
    samples: list[LayerSample],
    values: list[list[float]],
    title: str,
    cmap: str,
    label: str,
    pick: Any,
    low: float,
) -> None:
    layers = samples[-1].layers
    grid = _aligned(samples, values)
    chosen = list(range(len(layers)))
    if len(layers) > MAX_LAYERS:
        score = [pick([g[i] for g in grid if not math.isnan(g[i])] or [0.0]) for i in range(len(layers))]
        chosen = sorted(sorted(chosen, key=lambda i: -score[i])[:MAX_LAYERS])
        title += f" - {MAX_LAYERS} of {len(layers)} layers"
    matrix = [[grid[t][i] for t in range(len(samples))] for i in chosen]
    finite = [v for row in matrix for v in row if not math.isnan(v)]
    high = max(finite) if finite and max(finite) > low else low + 1.0
    image = axis.imshow(matrix, aspect="auto", cmap=cmap, interpolation="nearest", vmin=low, vmax=high)
    steps = [s.step for s in samples]
    ticks = list(range(0, len(steps), max(1, math.ceil(len(steps) / 12))))
    axis.set_xticks(ticks, [str(steps[t]) for t in ticks], fontsize=7)
    axis.set_yticks(
        range(len(chosen)),
        [_label(layers[i]) or "(root)" for i in chosen],
        fontsize=max(4, min(8, 400 // max(len(chosen), 1))),
    )
    axis.set_xlabel("sampled optimizer step")
    axis.set_title(title, fontsize=10)
    figure.colorbar(image, ax=axis, label=label, fraction=0.03, pad=0.01)


def _aligned(samples: list[LayerSample], values: list[list[float]]) -> list[list[float]]:
    """Each sample's values re-indexed to the last sample's layer order (layers are the same in a run)."""
    layers = samples[-1].layers
    out = []
    for sample, row in zip(samples, values):
        position = {name: i for i, name in enumerate(sample.layers)}
        out.append([row[position[name]] if name in position else math.nan for name in layers])
    return out
