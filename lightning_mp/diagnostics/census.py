"""``Census``: what one :func:`~lightning_mp.diagnostics.audit` saw, and the questions it answers.

One :class:`Row` per unique (op, dtype, phase, module) with call counts and matmul FLOPs, one :class:`Finding` per
precision-sensitive op that ran in half precision, and the views over them: ``select``, ``dtypes_of``,
``half_flops_fraction``, a printable ``table`` and a JSON-ready ``to_dict``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

HALF_DTYPES = frozenset({"float16", "bfloat16"})


@dataclass
class Row:
    """One unique (op, dtype, phase, module): ``count`` calls, ``flops`` matmul FLOPs summed over them."""

    op: str
    dtype: str
    phase: str
    module: str
    count: int = 0
    flops: int = 0


@dataclass
class Finding:
    """An op that ran in half precision although it is precision-sensitive; ``why`` says what goes wrong."""

    op: str
    dtype: str
    phase: str
    module: str
    why: str
    count: int = 0


def is_fp8(dtype: str) -> bool:
    """``True`` when every floating input of the op was an fp8 dtype (a torchao float8 matmul: e4m3 and/or e5m2)."""
    return all(part.startswith("float8") for part in dtype.split("+"))


def is_half(dtype: str) -> bool:
    """``True`` when every floating input of the op was float16/bfloat16 (mixed ``"bfloat16+float32"`` is not)."""
    return all(part in HALF_DTYPES for part in dtype.split("+"))


def _in_module(name: str, prefix: str | None) -> bool:
    return prefix is None or prefix == "" or name == prefix or name.startswith(prefix + ".")


@dataclass
class Census:
    """What ran during one :func:`audit`.

    ``rows``: one :class:`Row` per unique (op, dtype, phase, module), in order of first call. ``module`` is the
    qualified name from ``named_modules()`` (``""`` for the audited module itself and for code outside any
    submodule, ``"<backward>"`` for backward ops not attributable to a module). ``dtype`` is the set of floating
    input dtypes joined by ``"+"`` (``"-"`` when the op touched no floating tensor; ``"float32"`` for CUDA's fused
    fp16-in/fp32-out ``_softmax``/``_log_softmax``, which compute in float32). ``flops`` counts only
    matmul-like ops (mm/addmm/bmm/baddbmm/matmul/linear, attention, convolution; multiply-add = 2 FLOPs).
    ``risky``: :class:`Finding` per precision-sensitive op that ran in half precision.
    """

    rows: list[Row]
    risky: list[Finding]
    large_reduction: int = 65536

    def select(
        self, op: str | Iterable[str] | None = None, phase: str | None = None, module: str | None = None
    ) -> list[Row]:
        """Rows matching all given filters: ``op`` a name or names, ``phase`` ``"forward"``/``"backward"``,
        ``module`` a module-name prefix (``"enc"`` matches ``"enc"`` and ``"enc.0"``, not ``"enc2"``)."""
        ops = {op} if isinstance(op, str) else (set(op) if op is not None else None)
        return [
            r
            for r in self.rows
            if (ops is None or r.op in ops) and (phase is None or r.phase == phase) and _in_module(r.module, module)
        ]

    def dtypes_of(self, op: str, phase: str | None = None, module: str | None = None) -> set[str]:
        """The dtypes ``op`` ran in, e.g. ``{"float32"}``; empty when it never ran (under these filters)."""
        return {r.dtype for r in self.select(op, phase, module)}

    def half_flops_fraction(
        self, ops: str | Iterable[str] | None = None, module: str | None = None, phase: str | None = None
    ) -> float:
        """Share in [0, 1] of matmul FLOPs computed in float16/bfloat16, optionally restricted to op names, a
        module-name prefix and a phase. Raises ``ValueError`` when the selection holds no matmul FLOPs at all."""
        rows = [r for r in self.select(ops, phase, module) if r.flops > 0]
        total = sum(r.flops for r in rows)
        if total == 0:
            raise ValueError(
                f"no matmul FLOPs recorded for ops={ops!r}, module={module!r}, phase={phase!r}, so there is no "
                f"fraction to take; ops with FLOPs in this census: {sorted({r.op for r in self.rows if r.flops})}"
            )
        return sum(r.flops for r in rows if is_half(r.dtype)) / total

    def fp8_flops_fraction(self, module: str | None = None, phase: str | None = None) -> float:
        """Share in [0, 1] of matmul FLOPs whose operands were fp8 (torchao float8 layers), optionally for a
        module-name prefix and a phase. Raises ``ValueError`` when the selection holds no matmul FLOPs."""
        rows = [r for r in self.select(None, phase, module) if r.flops > 0]
        total = sum(r.flops for r in rows)
        if total == 0:
            raise ValueError(f"no matmul FLOPs recorded for module={module!r}, phase={phase!r}")
        return sum(r.flops for r in rows if is_fp8(r.dtype)) / total

    def _fraction_or_none(self) -> float | None:
        return self.half_flops_fraction() if any(r.flops for r in self.rows) else None

    def summary(self) -> str:
        """``"matmul FLOPs in half precision: 99.2%"`` (or ``n/a`` when no matmul ran), and the fp8 share when any
        matmul ran in fp8."""
        fraction = self._fraction_or_none()
        if fraction is None:
            return "matmul FLOPs in half precision: n/a (no matmul FLOPs recorded)"
        fp8 = self.fp8_flops_fraction()
        return f"matmul FLOPs in half precision: {100 * fraction:.1f}%" + (f"; in fp8: {100 * fp8:.1f}%" if fp8 else "")

    def table(self) -> str:
        """A fixed-width table sorted by FLOPs then calls (both descending), the summary line and the findings."""
        header = ("op", "phase", "dtype", "calls", "GFLOPs", "module")
        ordered = sorted(self.rows, key=lambda r: (-r.flops, -r.count))
        body = [
            (r.op, r.phase, r.dtype, str(r.count), f"{r.flops / 1e9:.4g}" if r.flops else "-", r.module or "(root)")
            for r in ordered
        ]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
        right = {3, 4}  # numbers are right-aligned

        def fmt(line: tuple[str, ...]) -> str:
            cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))]
            return "  ".join(cells).rstrip()

        lines = [fmt(header), "  ".join("-" * w for w in widths), *map(fmt, body), "", self.summary()]
        lines.append(f"risky ops ({len(self.risky)}):" if self.risky else "risky ops: none")
        lines += [f"  {f.op} [{f.dtype}, {f.phase}] in {f.module or '(root)'} x{f.count}: {f.why}" for f in self.risky]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable view: rows, risky, large_reduction and half_flops_fraction (``None`` without FLOPs)."""
        rows, risky = [asdict(r) for r in self.rows], [asdict(f) for f in self.risky]
        fp8 = self.fp8_flops_fraction() if any(r.flops for r in self.rows) else None
        return {"rows": rows, "risky": risky, "large_reduction": self.large_reduction,
                "half_flops_fraction": self._fraction_or_none(), "fp8_flops_fraction": fp8}  # fmt: skip
