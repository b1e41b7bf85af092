"""lightning_mp: mixed-precision training for PyTorch Lightning that you can tune, inspect and trust."""

from lightning_mp.checkpoints import TensorSubclassCheckpointIO
from lightning_mp.diagnostics import Census, PrecisionMonitor, audit
from lightning_mp.master import MasterWeights
from lightning_mp.plugin import MixedPrecisionPlugin
from lightning_mp.policy import CastPolicy
from lightning_mp.scaler import DynamicLossScaler

__all__ = [
    "CastPolicy",
    "Census",
    "audit",
    "DynamicLossScaler",
    "MasterWeights",
    "MixedPrecisionPlugin",
    "PrecisionMonitor",
    "TensorSubclassCheckpointIO",
]
__version__ = "0.1.0"
