"""Master weights: the model runs in fp16/bf16 while the optimizer updates exact higher-precision values.

- :mod:`lightning_mp.master.flat`: :class:`MasterWeights`, fp32 masters in one flat buffer per device
  (``master_weights=True``).
"""

from lightning_mp.master.flat import NORM_TYPES, MasterWeights, is_norm

__all__ = ["MasterWeights", "NORM_TYPES", "is_norm"]
