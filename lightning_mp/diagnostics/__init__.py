"""Diagnostics: what ran in which dtype (``audit``); during training, the loss scale, where each skipped step
overflowed and the per-layer gradient underflow and headroom (``PrecisionMonitor``; in a Fabric loop
``FabricPrecisionMonitor``); and the run report (``report``).

Diagnostics observe the numerics parts (scaler, master weights, policy); the numerics parts never import them.
"""

from lightning_mp.diagnostics.advice import Advice, advise
from lightning_mp.diagnostics.audit import audit
from lightning_mp.diagnostics.census import Census, Finding, Row
from lightning_mp.diagnostics.fabric_monitor import FabricPrecisionMonitor
from lightning_mp.diagnostics.history import LayerSample, OverflowRecord, RunHistory
from lightning_mp.diagnostics.monitor import PrecisionMonitor
from lightning_mp.diagnostics.run_report import ReportFiles, report

__all__ = [
    "Advice",
    "Census",
    "FabricPrecisionMonitor",
    "Finding",
    "LayerSample",
    "OverflowRecord",
    "PrecisionMonitor",
    "ReportFiles",
    "Row",
    "RunHistory",
    "advise",
    "audit",
    "report",
]
