"""fp8 training through :class:`~lightning_mp.MixedPrecisionPlugin` (``fp8=...``), with torchao's float8.

- :mod:`~lightning_mp.fp8.config`: the recipe names, the ``Float8LinearConfig`` per device (real fp8 on CUDA
  compute capability >= 8.9, emulated on CPU), the error when torchao (the ``fp8`` extra) is missing;
- :mod:`~lightning_mp.fp8.convert`: which layers (the cast policy decides), their conversion, the setup table;
- :mod:`~lightning_mp.fp8.stats`: sampled per-layer statistics of the fp8 casts for the monitor and its report.

Nothing here imports torchao at module level: ``import lightning_mp`` never loads it.
"""

from lightning_mp.fp8.config import RECIPES
from lightning_mp.fp8.convert import Fp8Layer, Fp8Training

__all__ = ["RECIPES", "Fp8Layer", "Fp8Training"]
