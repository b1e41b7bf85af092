"""What a run's precision diagnostics recorded: the loss scale over steps, the skipped steps and where each one
overflowed, and the sampled per-layer gradient statistics. Plain data, saved as JSON next to the run's logs
(``precision_diagnostics.json``) so that :func:`lightning_mp.diagnostics.report` can be run on it later.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

#: The file :class:`RunHistory` is saved to, in the run's log directory.
HISTORY_FILE = "precision_diagnostics.json"

#: Causes of a skipped step, as :class:`OverflowRecord.cause` names them.
CAUSES = {
    "loss_scale": "finite without the loss scale: the scaled gradient overflowed fp16 (the scaler backs off)",
    "half_precision": "non-finite in half precision even unscaled, finite in fp32: the module overflows half precision",
    "model": "non-finite even in fp32 without the loss scale: the model or the data produce it, not the precision",
    "not_reproduced": "a replay of the step's forward and backward stayed finite: the non-finite gradients came from "
    "elsewhere (a hook after backward, the sum of accumulated micro-batches, a non-deterministic op)",
    "gradients_only": "not replayed (manual optimization, or a model sharded by FSDP2): only the gradients are "
    "inspected",
    "failed": "localisation raised an error (see note)",
}


@dataclass
class OverflowRecord:
    """One skipped optimizer step and where its non-finite values came from.

    ``phase`` is ``"forward"`` or ``"backward"`` when the origin was found, else ``""``. ``module`` is the
    qualified name of the module whose code ran the first operation with a non-finite output (``""`` with
    ``module_class`` ``"(outside any module)"`` for code in ``training_step`` itself), ``op`` that aten operation
    and ``input_amax`` the largest finite magnitude among its inputs (what it was fed before it overflowed).
    ``nonfinite_params`` are the parameters whose (accumulated, unscaled) gradients held inf/NaN.
    ``seconds`` is the wall time the localisation took (its cost for this skipped step).
    """

    step: int
    scale_before: float
    scale_after: Optional[float] = None
    cause: str = "not_reproduced"
    phase: str = ""
    module: str = ""
    module_class: str = ""
    op: str = ""
    input_amax: Optional[float] = None
    nonfinite_params: list[str] = field(default_factory=list)
    micro_batch: Optional[int] = None
    replays: int = 0
    seconds: float = 0.0
    ranks: list[int] = field(default_factory=list)
    note: str = ""

    @property
    def located(self) -> bool:
        return self.phase in ("forward", "backward")

    def place(self) -> str:
        """The code the origin ran in: ``"encoder.layer.3.output.dense (Linear)"``, ``"training_step (outside any
        module)"`` or ``"the root module (MyModel)"``."""
        if self.module:
            return f"{self.module} ({self.module_class})"
        if self.module_class == "(outside any module)":
            return "training_step (outside any module)"
        return f"the root module ({self.module_class})"

    def where(self) -> str:
        """``"encoder.layer.3.output.dense (Linear), forward, op mul"``, or the cause when not located."""
        if not self.located:
            return self.cause.replace("_", " ")
        if self.module:
            return f"{self.module} ({self.module_class}), {self.phase}, op {self.op}"
        if self.module_class == "(outside any module)":
            return f"training_step outside any module, {self.phase}, op {self.op}"
        return f"(root) {self.module_class}, {self.phase}, op {self.op}"


#: Columns of a per-layer gradient statistics row, in order.
STAT_COLUMNS = ("numel", "zeros", "flush", "subnormal", "nonfinite", "amax")


@dataclass
class LayerSample:
    """Gradient statistics of every layer at one sampled optimizer step.

    ``rows[i]`` holds, for ``layers[i]``: value count, exact zeros, values that flush to zero in fp16 after
    scaling (``0 < |g * scale| < 2**-24``), values in fp16's subnormal range after scaling (``2**-24 <= |g * scale|
    < 2**-14``), non-finite values, and the largest magnitude after scaling (``amax``; inf when non-finite).
    ``kind`` is ``"param_grads"`` (the gradients the optimizer steps with) or ``"activation_grads"``.
    """

    step: int
    scale: float
    kind: str
    layers: list[str]
    rows: list[list[float]]

    def column(self, name: str) -> list[float]:
        index = STAT_COLUMNS.index(name)
        return [row[index] for row in self.rows]

    def underflow_share(self) -> list[float]:
        """Per layer: share of values that are subnormal or flush to zero in fp16 after scaling (zeros not counted)."""
        return [(row[2] + row[3]) / row[0] if row[0] else 0.0 for row in self.rows]

    def zero_share(self) -> list[float]:
        return [row[1] / row[0] if row[0] else 0.0 for row in self.rows]

    def headroom(self) -> list[Optional[float]]:
        """Per layer: powers of two between the largest scaled magnitude and fp16's largest value (65504);
        ``None`` for a layer whose gradient is all zeros, negative or ``-inf`` when it overflowed."""
        return [headroom_bits(row[5]) for row in self.rows]


FP16_MAX = 65504.0


def format_number(value: float) -> str:
    """A scale as YAML/Python takes it: ``1048576``, not ``1.04858e+06``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def format_scale(value: float) -> str:
    """``2^20`` for a power of two, else :func:`format_number`."""
    exponent = math.log2(value) if value > 0 and math.isfinite(value) else 0.5
    return f"2^{int(exponent)}" if float(exponent).is_integer() else format_number(value)


def headroom_bits(amax: float) -> Optional[float]:
    """``log2(65504 / amax)``: how many doublings of the scale the largest value could take before overflowing."""
    if amax == 0.0:
        return None
    if not math.isfinite(amax):
        return -math.inf
    return math.log2(FP16_MAX / amax)


@dataclass
class RunHistory:
    """Everything the monitor recorded during one ``fit``.

    ``precision`` is ``"fp16"``, ``"bf16"`` or ``"fp32"``; ``scaler`` holds the scaler's settings (empty without
    one); ``scale_changes`` lists ``(step, scale)`` for the first step and every change; ``skipped`` the optimizer
    steps that were skipped; ``steps`` the number of optimizer steps seen; ``error`` the message of an error that
    ended the run (e.g. the scaler's ``FloatingPointError`` at ``min_scale``); ``half_failure`` what a
    :class:`~lightning_mp.diagnostics.half_failure.HalfPrecisionError` that ended it found (its
    first :class:`~lightning_mp.diagnostics.half_failure.HalfFailure` as a dict, the others under ``"others"``;
    empty otherwise).
    """

    precision: str = "fp32"
    scaler: dict[str, Any] = field(default_factory=dict)
    steps: int = 0
    scale_changes: list[tuple[int, float]] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    overflows: list[OverflowRecord] = field(default_factory=list)
    samples: list[LayerSample] = field(default_factory=list)
    sample_every: int = 0
    error: str = ""
    half_failure: dict[str, Any] = field(default_factory=dict)
    # --- fp8 (lightning_mp.fp8.stats): the recipe and the sampled statistics of the fp8 casts, as plain dicts
    fp8_recipe: str = ""
    fp8_samples: list[dict[str, Any]] = field(default_factory=list)

    def record_scale(self, step: int, scale: float) -> None:
        if not self.scale_changes or self.scale_changes[-1][1] != scale:
            self.scale_changes.append((step, scale))

    def scale_at(self, step: int) -> Optional[float]:
        """The loss scale in effect at optimizer step ``step`` (``None`` before the first record)."""
        current = None
        for at, scale in self.scale_changes:
            if at > step:
                break
            current = scale
        return current

    def samples_of(self, kind: str = "param_grads") -> list[LayerSample]:
        return [sample for sample in self.samples if sample.kind == kind]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["scale_changes"] = [list(pair) for pair in self.scale_changes]
        return _json_safe(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunHistory:
        data = _from_json_safe(dict(data))
        data["overflows"] = [OverflowRecord(**record) for record in data.get("overflows", [])]
        data["samples"] = [LayerSample(**sample) for sample in data.get("samples", [])]
        data["scale_changes"] = [(int(step), float(scale)) for step, scale in data.get("scale_changes", [])]
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{HISTORY_FILE} has keys {unknown} that RunHistory does not know (known: {sorted(known)})."
            )
        return cls(**data)

    def save(self, directory: Union[str, Path], suffix: str = "") -> Path:
        """Write ``precision_diagnostics{suffix}.json`` into ``directory`` (``suffix``: ``"_1"`` for a second run
        reported into the same directory, see :func:`lightning_mp.diagnostics.run_report.free_suffix`)."""
        path = Path(directory) / HISTORY_FILE.replace(".json", f"{suffix}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> RunHistory:
        """Read a saved history: ``path`` is the JSON file or the directory holding it."""
        path = Path(path)
        if path.is_dir():
            path = path / HISTORY_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"No precision diagnostics at {path}: pass a run's log directory (where PrecisionMonitor wrote "
                f"{HISTORY_FILE}), that file, or a Trainer that ran with a PrecisionMonitor callback."
            )
        return cls.from_dict(json.loads(path.read_text()))


def _json_safe(value: Any) -> Any:
    """inf/NaN are not JSON: write them as strings, read back by :func:`_from_json_safe`."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


def _from_json_safe(value: Any) -> Any:
    if value in ("inf", "-inf", "nan"):
        return float(value)
    if isinstance(value, dict):
        return {key: _from_json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json_safe(item) for item in value]
    return value
