"""Advice derived from a run's :class:`RunHistory`: what to change, and the evidence for it.

Each rule looks for one symptom and, when it finds it, says which setting to change and quotes the data:

- ``fp32_modules`` (a crashed run): the run ended with a :class:`~lightning_mp.diagnostics.half_failure.
  HalfPrecisionError` (ops with no half kernel, constants beyond the half range) -> run those modules in fp32
  (``fp32_code`` when the code is in ``training_step`` or the root module, which no module rule reaches).

- ``fp32_modules``: one module was where the inf/NaN was born in most skipped steps, and it overflows half
  precision even without the loss scale -> run it in fp32 with a casting-policy rule.
  When that place is ``training_step``'s own code (or the root module's ``forward``), which no module rule reaches,
  the rule is ``fp32_code``: compute that op in float32 there.
- ``init_scale``: many of the first steps were skipped while the scale came down -> start lower.
- ``hysteresis``: after the start, skips come in isolated bursts that are not the scaler probing a higher scale
  -> tolerate that many overflows before backing off.
- ``growth_interval``: layers lose a share of their gradient values below fp16's normal range while the largest
  gradient has ample headroom -> the scale is too low; let it grow sooner.
- ``bf16``: fp16 keeps fighting (a high skip rate, repeated half-precision overflows, or the run died at
  ``min_scale``) -> bf16 has fp32's exponent range and needs no loss scale.
- ``model``: the inf/NaN appears even in fp32 without scaling -> no precision setting fixes it.
- ``fp8``: fp8 layers keep losing values below fp8's range after scaling -> the rowwise recipe, or ``fp8_exclude``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from lightning_mp.diagnostics.history import OverflowRecord, RunHistory
from lightning_mp.diagnostics.history import format_number as _number
from lightning_mp.diagnostics.history import format_scale as _scale
from lightning_mp.fp8.stats import fp8_advice

#: the first optimizer steps, where a too-high ``init_scale`` shows
STARTUP_STEPS = 50
#: skips in the startup window that make ``init_scale`` worth lowering
STARTUP_SKIPS = 3
#: finite steps that separate two bursts of skips
BURST_GAP = 20
#: a skip this many steps after the scale grew is the scaler probing, not a spike
PROBE_STEPS = 2
#: bursts after the startup needed for the hysteresis advice
MIN_BURSTS = 3
#: share of a layer's gradient values below fp16's normal range (after scaling) that counts as underflowing
UNDERFLOW_SHARE = 0.01
#: powers of two of headroom (largest scaled gradient anywhere vs 65504) that count as ample
AMPLE_HEADROOM_BITS = 4.0
#: the last samples looked at by the underflow rule; it needs the symptom in at least half of them
RECENT_SAMPLES = 5
#: skip rate after the startup above which fp16 is "fighting"
FIGHTING_SKIP_RATE = 0.02
#: half-precision overflows (finite in fp32) that, together, say fp16's range is too small for this model
FIGHTING_HALF_OVERFLOWS = 3


@dataclass(frozen=True)
class Advice:
    """One piece of advice: the ``rule`` that fired, the ``change`` to make, and the ``evidence`` it rests on."""

    rule: str
    change: str
    evidence: str


def advise(history: RunHistory) -> list[Advice]:
    """Every rule that fires on ``history``, in the order of the module docstring."""
    return [advice for rule in RULES if (advice := rule(history)) is not None]


def _half_failure(history: RunHistory) -> Optional[Advice]:
    failure = history.half_failure
    if not failure:
        return None
    evidence = (
        f"the run ended at {_place(failure)}, op {failure['op']}"
        + (f" ({failure['where']})" if failure["where"] else "")
        + f": {failure['error']!r} in {failure['dtype']} on {failure['device']}"
        + "".join(f"; also {_place(other)}, op {other['op']}" for other in failure.get("others", ()))
        + "."
    )
    # the fix as the error printed it: the whole policy line, the run's rules included
    return Advice("fp32_modules" if failure["rule"] else "fp32_code", failure["fix"], evidence)


def _place(failure: dict[str, Any]) -> str:
    return f"{failure['module']} ({failure['module_class']})" if failure["module"] else failure["module_class"]


def _fp32_modules(history: RunHistory) -> Optional[Advice]:
    skipped = len(history.skipped)
    counts: dict[tuple[str, str], list[OverflowRecord]] = {}
    for record in history.overflows:
        if record.located and record.cause == "half_precision":
            counts.setdefault((record.module, record.module_class), []).append(record)
    if not counts:
        return None
    (module, module_class), records = max(counts.items(), key=lambda item: len(item[1]))
    steps = [r.step for r in records]
    if len(steps) < 2 or len(steps) * 2 <= skipped:
        return None
    phases = sorted({r.phase for r in records})
    evidence = (
        f"{records[0].place()} was where the inf/NaN was born in {len(steps)} of {skipped} skipped steps "
        f"({'/'.join(phases)}; steps {_steps(steps)}, op {records[0].op}), and it stays non-finite in half "
        "precision without the loss scale but finite in fp32."
    )
    if not module:  # training_step's own code, or the root module's forward: no module rule reaches it alone
        where = "training_step" if module_class == "(outside any module)" else f"{module_class}.forward"
        return Advice(
            "fp32_code",
            f"compute {records[0].op} in {where} in float32: cast its inputs with .float() (no fp32_modules rule "
            "reaches code outside a submodule)",
            evidence,
        )
    return Advice(
        "fp32_modules",
        f'policy: {{fp32_modules: ["{module}"]}}  (MixedPrecisionPlugin(policy={{"fp32_modules": ["{module}"]}}))',
        evidence,
    )


def _init_scale(history: RunHistory) -> Optional[Advice]:
    if history.precision != "fp16" or not history.scaler.get("dynamic", False) or history.scaler.get("check_only"):
        return None
    unavoidable = {r.step for r in history.overflows if r.cause in ("half_precision", "model")}
    early = [step for step in history.skipped if step < STARTUP_STEPS and step not in unavoidable]
    if len(early) < STARTUP_SKIPS:
        return None
    first_finite = next((step for step in range(STARTUP_STEPS + 1) if step not in set(history.skipped)), None)
    start = history.scale_at(early[0]) or float(history.scaler.get("scale", 0.0))
    settled = history.scale_at(first_finite) if first_finite is not None else None
    target = settled if settled is not None else (history.scale_at(early[-1]) or start)
    return Advice(
        "init_scale",
        f"scaler: {{init_scale: {_number(target)}}}",
        f"{len(early)} of the first {STARTUP_STEPS} optimizer steps were skipped for the loss scale (steps "
        f"{_steps(early)}) while the scale fell from {_scale(start)} to {_scale(target)}"
        + (f", where step {first_finite} was the first to run" if first_finite is not None else "")
        + ".",
    )


def _bursts(steps: list[int]) -> list[list[int]]:
    bursts: list[list[int]] = []
    for step in steps:
        if bursts and step - bursts[-1][-1] <= BURST_GAP:
            bursts[-1].append(step)
        else:
            bursts.append([step])
    return bursts


def _hysteresis(history: RunHistory) -> Optional[Advice]:
    if history.precision != "fp16" or not history.scaler.get("dynamic", False):
        return None
    growths = [
        step for (step, scale), (_, before) in zip(history.scale_changes[1:], history.scale_changes) if scale > before
    ]
    spikes = [
        step
        for step in history.skipped
        if step >= STARTUP_STEPS and not any(0 <= step - grown <= PROBE_STEPS for grown in growths)
    ]
    bursts = _bursts(spikes)
    if len(bursts) < MIN_BURSTS:
        return None
    longest = max(burst[-1] - burst[0] + 1 for burst in bursts)
    current = int(history.scaler.get("hysteresis", 1))
    if longest > 3 or current > longest:
        return None
    return Advice(
        "hysteresis",
        f"scaler: {{hysteresis: {longest + 1}}}",
        f"after step {STARTUP_STEPS}, {len(spikes)} skipped steps came in {len(bursts)} isolated bursts of at most "
        f"{longest} step(s) (starting at steps {_steps([b[0] for b in bursts])}), none right after the scale grew; "
        f"with hysteresis={current} each burst backs the scale off.",
    )


def _growth_interval(history: RunHistory) -> Optional[Advice]:
    if history.precision != "fp16" or history.scaler.get("check_only") or not history.scaler:
        return None
    recent = history.samples_of("param_grads")[-RECENT_SAMPLES:]
    hits = []
    for sample in recent:
        shares = sample.underflow_share()
        headrooms = [h for h in sample.headroom() if h is not None]
        if not shares or not headrooms:
            continue
        worst = max(range(len(shares)), key=lambda i: shares[i])
        if shares[worst] >= UNDERFLOW_SHARE and min(headrooms) >= AMPLE_HEADROOM_BITS:
            hits.append((sample, worst, shares[worst], min(headrooms)))
    if not recent or len(hits) * 2 < len(recent):
        return None
    sample, worst, share, headroom = hits[-1]
    interval = int(history.scaler.get("growth_interval", 2000))
    if history.scaler.get("dynamic", True):
        change = f"scaler: {{growth_interval: {max(1, interval // 4)}}}"
    else:
        change = f"a static scale of {_number(sample.scale * 2 ** int(headroom - 1))} (now {_number(sample.scale)})"
    unavoidable = [r.step for r in history.overflows if r.cause in ("half_precision", "model")]
    return Advice(
        "growth_interval",
        change,
        f"in {len(hits)} of the last {len(recent)} samples a layer lost >= {UNDERFLOW_SHARE:.0%} of its gradient "
        f"values below fp16's normal range after scaling (at step {sample.step}: {sample.layers[worst]}, "
        f"{share:.1%}), while the largest scaled gradient of any layer stayed {headroom:.1f} powers of two below "
        f"65504 (scale {_scale(sample.scale)}, growth_interval={interval}): the scale could be about "
        f"2^{int(headroom) - 1} times higher."
        + (
            f" {len(unavoidable)} backoffs came from overflows that no scale avoids (steps {_steps(unavoidable)}): "
            "fix those first (fp32_modules), they keep pushing the scale down."
            if unavoidable
            else ""
        ),
    )


def _bf16(history: RunHistory) -> Optional[Advice]:
    if history.precision != "fp16":
        return None
    reasons = []
    later = [step for step in history.skipped if step >= STARTUP_STEPS]
    after = max(history.steps - STARTUP_STEPS, 0)
    if after and len(later) >= 5 and len(later) / after > FIGHTING_SKIP_RATE:
        reasons.append(
            f"{len(later)} of {after} optimizer steps after the first {STARTUP_STEPS} were skipped "
            f"({len(later) / after:.1%})"
        )
    half = [r.step for r in history.overflows if r.cause == "half_precision"]
    if len(half) >= FIGHTING_HALF_OVERFLOWS:
        reasons.append(
            f"{len(half)} skipped steps overflowed half precision even without the loss scale (steps {_steps(half)})"
        )
    if "FloatingPointError" in history.error:
        reasons.append(f"the run ended with {history.error.splitlines()[0][:200]}")
    if not reasons:
        return None
    return Advice(
        "bf16",
        "trainer.precision: bf16-mixed  (MixedPrecisionPlugin('bf16-mixed'); GPUs from Ampere on, or CPUs with "
        "AVX512-BF16/AMX)",
        "fp16 keeps fighting: " + "; ".join(reasons) + ". bf16 has fp32's exponent range and needs no loss scale.",
    )


def _model(history: RunHistory) -> Optional[Advice]:
    records = [r for r in history.overflows if r.cause == "model"]
    if not records:
        return None
    first = records[0]
    return Advice(
        "model",
        f"fix the computation in {first.place()}: no precision setting helps",
        f"{len(records)} skipped step(s) (steps {_steps([r.step for r in records])}) are non-finite even in fp32 "
        f"without the loss scale; the first inf/NaN came from {first.where()} (largest finite input "
        f"{first.input_amax or 0.0:g}). Check that op's inputs (log/sqrt of negatives, division by zero), the data "
        "and the "
        "learning rate.",
    )


def _fp8(history: RunHistory) -> Optional[Advice]:
    # --- fp8 (lightning_mp.fp8.stats): layers whose fp8 casts flush values -> rowwise, or keep them out of fp8
    found = fp8_advice(history)
    return Advice("fp8", *found) if found is not None else None


def _steps(steps: list[int], shown: int = 8) -> str:
    text = ", ".join(str(step) for step in steps[:shown])
    return text + (f", ... ({len(steps)} in all)" if len(steps) > shown else "")


RULES: list[Callable[[RunHistory], Optional[Advice]]] = [
    _half_failure,
    _fp32_modules,
    _init_scale,
    _hysteresis,
    _growth_interval,
    _bf16,
    _model,
    _fp8,
]
