"""Sampled statistics of the fp8 casts of every converted layer: the fp8 counterpart of the underflow heatmap.

On a sampled step, :class:`Fp8Sampler` hooks each torchao ``Float8Linear`` and, for the three tensors it casts (its
``input``, its ``weight`` and the gradient of its output, ``grad_output``), takes the scale torchao computes (fp8
max / amax, per tensor or per row as the layer's recipe says, rounded down to a power of two where the recipe does)
and counts, after scaling: values that ``saturate`` (above the fp8 maximum: clamped), that ``flush`` (nonzero but
below the fp8 dtype's smallest subnormal: they round to zero or to one subnormal step) and that are ``subnormal``
(fewer mantissa bits), with ``amax`` and the smallest ``scale``. Saturation counts values beyond the maximum by more
than half a step (they round past it and are clamped): with dynamic scales only rounding of the scale can do that.
Everything stays on the device until the monitor's one read per sampled step; on other steps no hook is installed,
so nothing runs.

:func:`fp8_section` renders the report's table and :func:`fp8_advice` the advice: a layer that loses a share of its
values below fp8's range (an outlier stretches the tensor's one scale) -> the rowwise recipe, or, when already
rowwise, keep the layer out of fp8 (``fp8_exclude``). Nothing here imports torchao.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor, nn

if TYPE_CHECKING:  # torchao has no types (Any); named for the reader
    from torchao.float8.float8_linear import Float8Linear

#: Columns of one cast's row.
COLUMNS = ("numel", "zeros", "flush", "subnormal", "saturated", "amax", "scale")
CASTS = ("input", "weight", "grad_output")
#: share of a cast's values flushed below fp8's range that makes a layer worth advice
FLUSH_SHARE = 0.01
#: the last samples the advice looks at; it needs the symptom in at least half of them
RECENT = 5


def _settings(layer: Float8Linear, cast: str) -> tuple[torch.dtype, bool, bool]:
    """(fp8 dtype, rowwise, power-of-two scales) of ``cast`` under the layer's torchao config."""
    config = layer.config
    cast_config = getattr(config, f"cast_config_{cast}")
    rowwise = cast_config.scaling_granularity.value == "axiswise"
    return cast_config.target_dtype, rowwise, bool(config.round_scales_to_power_of_2)


def cast_stats(tensor: Tensor, dtype: torch.dtype, rowwise: bool, power_of_two: bool) -> Tensor:
    """One row (see :data:`COLUMNS`) for ``tensor`` cast to fp8 ``dtype`` with a dynamic scale, as torchao does:
    ``scale = fp8_max / max(amax, 1e-12)`` over the tensor (or each row of its last dimension), in float64 then
    float32, floored to a power of two when ``power_of_two``. No host synchronisation."""
    info = torch.finfo(dtype)
    values = tensor.detach().float()
    magnitude = values.abs()
    amax = magnitude.amax(dim=-1, keepdim=True) if rowwise else magnitude.amax()
    scale = (info.max / amax.double().clamp(min=1e-12)).float()
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    scaled = magnitude * scale
    smallest_subnormal = info.tiny * info.eps
    zeros = (magnitude == 0).sum()
    flush = (scaled < smallest_subnormal).sum() - zeros
    subnormal = (scaled < info.tiny).sum() - (scaled < smallest_subnormal).sum()
    # above the maximum by more than half a step of the top binade: it would round beyond max, and is clamped
    saturated = (scaled > info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2).sum()
    numel = torch.full((), float(values.numel()), device=values.device)
    return torch.stack(
        [numel, zeros.float(), flush.float(), subnormal.float(), saturated.float(), magnitude.amax(), scale.min()]
    )


class Fp8Sampler:
    """Per converted layer and cast, the statistics above, summed over the micro-batches it is armed on."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._rows: dict[tuple[str, str], Tensor] = {}
        self._order: list[str] = []
        self.recipe = ""

    def arm(self, model: nn.Module) -> None:
        """Hook every ``Float8Linear`` of ``model`` (none: nothing happens) until :meth:`disarm`."""
        if self._handles:
            return
        self._order = []
        for name, layer in model.named_modules():
            # by class name (torchao is not imported here); fully_shard makes it a subclass, FSDPFloat8Linear
            if any(cls.__name__ == "Float8Linear" for cls in type(layer).__mro__) and hasattr(layer, "config"):
                self._order.append(name)
                self._handles.append(layer.register_forward_pre_hook(self._forward_hook(name)))
                self._handles.append(layer.register_forward_hook(self._output_hook(name)))

    def _forward_hook(self, name: str) -> Any:
        def hook(layer: Float8Linear, args: Any) -> None:
            if args and isinstance(args[0], Tensor):
                self._add(name, "input", cast_stats(args[0], *_settings(layer, "input")))
            weight = layer.weight
            weight = getattr(weight, "_tensor", weight)  # torchao's fp8 all-gather wrapper holds the plain tensor
            if type(weight) in (Tensor, nn.Parameter):  # not when FSDP2 all-gathered it already cast to fp8
                self._add(name, "weight", cast_stats(weight, *_settings(layer, "weight")))

        return hook

    def _output_hook(self, name: str) -> Any:
        def hook(layer: Float8Linear, args: Any, output: Any) -> None:
            if isinstance(output, Tensor) and output.requires_grad:
                settings = _settings(layer, "grad_output")
                output.register_hook(lambda grad: self._add(name, "grad_output", cast_stats(grad, *settings)))

        return hook

    def _add(self, name: str, cast: str, row: Tensor) -> None:
        previous = self._rows.get((name, cast))
        if previous is not None:
            row = torch.cat(
                [previous[:5] + row[:5], torch.maximum(previous[5:6], row[5:6]), torch.minimum(previous[6:], row[6:])]
            )
        self._rows[(name, cast)] = row

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def take(self) -> tuple[list[str], Tensor]:
        """``(layers, rows)``: rows of shape (3 * layers, 7), the casts of each layer in :data:`CASTS` order, reduced
        over ranks where a process group runs (counts summed, amax the largest, scale the smallest); start afresh."""
        layers = [name for name in self._order if any((name, cast) in self._rows for cast in CASTS)]
        if not layers:
            self._rows = {}
            return [], torch.zeros(0, len(COLUMNS))
        device = next(iter(self._rows.values())).device
        empty = torch.tensor([0.0] * 5 + [0.0, float("inf")], device=device)
        rows = torch.stack([self._rows.get((name, cast), empty) for name in layers for cast in CASTS])
        self._rows = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            parts = [rows[:, :5].contiguous(), rows[:, 5:6].contiguous(), rows[:, 6:].contiguous()]
            for part, op in zip(parts, ("SUM", "MAX", "MIN")):
                torch.distributed.all_reduce(part, op=getattr(torch.distributed.ReduceOp, op))
            rows = torch.cat(parts, dim=1)
        return layers, rows


def sample_record(step: int, layers: list[str], rows: list[list[float]]) -> dict[str, Any]:
    """The JSON-ready record of one sample: ``{"step", "layers", "casts": {cast: [row per layer]}}``."""
    casts = {cast: [rows[3 * i + k] for i in range(len(layers))] for k, cast in enumerate(CASTS)}
    return {"step": step, "layers": list(layers), "casts": casts}


def shares(record: dict[str, Any], cast: str, column: str) -> list[float]:
    """Per layer, the share of ``cast``'s values counted in ``column`` (``flush``, ``subnormal``, ``saturated``)."""
    index = COLUMNS.index(column)
    return [row[index] / row[0] if row[0] else 0.0 for row in record["casts"][cast]]


def _worst(history: Any) -> Optional[tuple[list[tuple[str, str, float, float]], int, int]]:
    recent = history.fp8_samples[-RECENT:]
    hits: dict[tuple[str, str], list[float]] = {}
    for record in recent:
        for cast in CASTS:
            for layer, share in zip(record["layers"], shares(record, cast, "flush")):
                if share >= FLUSH_SHARE:
                    hits.setdefault((layer, cast), []).append(share)
    found = [
        (layer, cast, values[-1], record_amax(recent[-1], layer, cast))
        for (layer, cast), values in hits.items()
        if 2 * len(values) >= len(recent)
    ]
    return (sorted(found, key=lambda item: -item[2]), len(recent), recent[-1]["step"]) if found else None


def record_amax(record: dict[str, Any], layer: str, cast: str) -> float:
    rows = record["casts"][cast]
    return rows[record["layers"].index(layer)][COLUMNS.index("amax")] if layer in record["layers"] else 0.0


def fp8_advice(history: Any) -> Optional[tuple[str, str]]:
    """``(change, evidence)`` when layers keep losing values below fp8's range, else ``None``."""
    worst = _worst(history)
    if worst is None:
        return None
    found, samples, step = worst
    layers = list(dict.fromkeys(layer for layer, _, _, _ in found))
    detail = "; ".join(
        f"{layer} {cast}: {share:.1%} flushed (amax {amax:.3g})" for layer, cast, share, amax in found[:4]
    )
    evidence = (
        f"in at least half of the last {samples} samples (last at step {step}) {len(layers)} fp8 layer(s) "
        f"lost >= {FLUSH_SHARE:.0%} of a cast's values below fp8's smallest subnormal after scaling: "
        f"{detail}. One large value (amax) sets the scale of the whole tensor, so the small ones flush."
    )
    if history.fp8_recipe == "tensorwise":
        return (
            "fp8: rowwise  (MixedPrecisionPlugin(fp8='rowwise'): one scale per row, so an outlier row does not "
            "flush the others)",
            evidence,
        )
    shown = ", ".join(f'"{layer}"' for layer in layers[:6])
    return (f"policy: {{fp8_exclude: [{shown}]}}  (those layers stay in bf16)", evidence)


def fp8_section(history: Any) -> list[str]:
    """The report's Markdown section on the fp8 casts (empty when the run sampled none)."""
    if not history.fp8_samples:
        return []
    last = history.fp8_samples[-1]
    lines = [
        "## fp8 casts per layer",
        "",
        f"At the last sample (step {last['step']}, recipe {history.fp8_recipe or 'unknown'}), per converted layer "
        "and cast: the share of values that flush below fp8's smallest subnormal after scaling, that are "
        "subnormal, that saturate at the fp8 maximum, the largest magnitude and the scale.",
        "",
        "| layer | cast | values | flush | subnormal | saturate | amax | scale |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cast in CASTS:
        for layer, row in zip(last["layers"], last["casts"][cast]):
            count = row[0] or 1.0
            lines.append(
                f"| {layer} | {cast} | {row[0]:.0f} | {row[2] / count:.2%} | {row[3] / count:.2%} | "
                f"{row[4] / count:.2%} | {row[5]:.3g} | {row[6]:.3g} |"
            )
    return lines + [""]
