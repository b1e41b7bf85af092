"""Dynamic loss scaling, independent of any trainer: :class:`DynamicLossScaler` and what it is made of.

- :mod:`~lightning_mp.scaler.loss_scaler`: the scaler (scale the loss, unscale and check the gradients, update), which
  owns its counters as one :class:`~lightning_mp.scaler.rules.ScalerState`;
- :mod:`~lightning_mp.scaler.rules`: growth, backoff, hysteresis, ``min_scale`` / ``max_scale``,
  ``max_consecutive_skips`` and the error horizon, each written once, as the table the host applies;
- :mod:`~lightning_mp.scaler.device`: the state on the device, updated by the table generated from the rules;
- :mod:`~lightning_mp.scaler.settings`: the settings' checks, the checkpoint's form of the state, what the plugin's
  ``scaler=`` means.

The gradients it checks (grouped per device and dtype, the check itself) are :mod:`lightning_mp.grads`, below it.
"""

from lightning_mp.scaler.loss_scaler import DynamicLossScaler
from lightning_mp.scaler.settings import FP32_MAX

__all__ = ["DynamicLossScaler", "FP32_MAX"]
