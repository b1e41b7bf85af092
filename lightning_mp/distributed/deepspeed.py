"""DeepSpeed: refused, with how to get the same features from DeepSpeed itself.

DeepSpeed's engine owns the loss scaler, the fp32 master weights and gradient clipping (its ZeRO optimizer wraps
the user's one), so a second scaler and second masters on top of it cannot be sound: the engine would scale an
already scaled loss and step masters the plugin does not see. Lightning's ``DeepSpeedStrategy`` pairs only with
its own ``DeepSpeedPrecision``, which hands DeepSpeed its fp16/bf16 settings.
"""

from __future__ import annotations

from typing import Any

#: The message raised when :class:`~lightning_mp.MixedPrecisionPlugin` meets a DeepSpeed strategy.
DEEPSPEED_REFUSAL = (
    "MixedPrecisionPlugin cannot run under {strategy}: DeepSpeed runs its own loss scaler, fp32 master weights "
    "and gradient clipping inside its engine, and a second scaler and second masters on top of them would "
    "scale the loss twice and step weights DeepSpeed does not see. Drop the plugin and let DeepSpeed do it:\n"
    "  fp16:  Trainer(strategy=DeepSpeedStrategy(stage=2, loss_scale=0, initial_scale_power=16, "
    "loss_scale_window=1000, hysteresis=2, min_loss_scale=1), precision='16-mixed')\n"
    "         (loss_scale=0 is dynamic scaling; 2**initial_scale_power is the first scale, loss_scale_window the "
    'growth interval), or in a DeepSpeed config: {{"fp16": {{"enabled": true, "loss_scale": 0, '
    '"initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}}}}\n'
    "  bf16:  Trainer(strategy='deepspeed_stage_2', precision='bf16-mixed'), or {{\"bf16\": {{\"enabled\": true}}}}\n"
    '  Gradient clipping: Trainer(gradient_clip_val=...) or {{"gradient_clipping": 1.0}} in the config. '
    "DeepSpeed keeps fp32 master weights itself in both modes."
)


def refuse_deepspeed(strategy: Any) -> None:
    """Raise the :data:`DEEPSPEED_REFUSAL` error for ``strategy`` (a ``DeepSpeedStrategy`` or its name).

    Raises:
        ValueError: always.
    """
    name = repr(strategy) if isinstance(strategy, str) else type(strategy).__name__
    raise ValueError(DEEPSPEED_REFUSAL.format(strategy=name))
