"""Diagnostics: what ran in which dtype (``audit``), and what the loss scale, gradients and skipped steps said
during training (``PrecisionMonitor``).

Diagnostics observe the numerics parts (scaler, master weights, policy); the numerics parts never import them.
"""

from lightning_mp.diagnostics.audit import audit
from lightning_mp.diagnostics.census import Census, Finding, Row
from lightning_mp.diagnostics.monitor import PrecisionMonitor

__all__ = ["Census", "Finding", "PrecisionMonitor", "Row", "audit"]
