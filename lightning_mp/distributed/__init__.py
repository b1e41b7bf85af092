"""What each Lightning strategy needs from the plugin: DDP, FSDP2, and the refusals (DeepSpeed, FSDP1)."""

from lightning_mp.distributed.fsdp2 import mixed_precision_policy
from lightning_mp.distributed.strategies import MASTER_WEIGHTS_STRATEGIES, sync_for
from lightning_mp.distributed.sync import GradientSync

__all__ = ["GradientSync", "MASTER_WEIGHTS_STRATEGIES", "mixed_precision_policy", "sync_for"]
