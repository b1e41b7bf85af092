"""lightning_mp: mixed-precision training for PyTorch Lightning that you can tune, inspect and trust."""

from lightning_mp.plugin import MixedPrecisionPlugin
from lightning_mp.scaler import DynamicLossScaler

__all__ = ["DynamicLossScaler", "MixedPrecisionPlugin"]
__version__ = "0.1.0"
