"""What ``MixedPrecisionPlugin(fp8=...)`` accepts, and the torchao ``Float8LinearConfig`` it becomes on a device.

``fp8`` is ``None`` (off), one of torchao's recipe names (:data:`RECIPES`) or a ``Float8LinearConfig``. torchao is
an optional dependency (the ``fp8`` extra): it is imported only when ``fp8`` is set, and its absence is an error that
names the extra. Where it runs: real fp8 matmuls on CUDA devices of compute capability 8.9 or newer (Ada, Hopper,
Blackwell); emulated (values rounded to fp8, matmuls in fp32) on CPU, for correctness, not speed; a CUDA device
without fp8 support is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

#: torchao's recipe names (``torchao.float8.Float8LinearRecipeName``), and what each one does.
RECIPES: dict[str, str] = {
    "tensorwise": "one dynamic scale per tensor (e4m3 forward, e5m2 gradients): the fastest",
    "rowwise": "one dynamic scale per row, power-of-two scales, e4m3 everywhere: robust to outlier rows",
    "rowwise_with_gw_hp": "rowwise, with the weight gradient computed in high precision: the most accurate",
}
#: The compute capability from which CUDA devices have fp8 matmuls (``torch._scaled_mm``).
MIN_CAPABILITY = (8, 9)

#: a recipe name or a ``torchao.float8.Float8LinearConfig`` (torchao has no types: ``Any``)
Fp8Recipe = Union[str, Any]
#: what ``MixedPrecisionPlugin(fp8=...)`` takes: a recipe, or ``None`` for no fp8
Fp8Spec = Optional[Fp8Recipe]


def import_float8() -> Any:
    """``torchao.float8``, or an ``ImportError`` that says how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as error:
        raise ImportError(
            "MixedPrecisionPlugin(fp8=...) trains with torchao's float8, and torchao is not installed: "
            'pip install "lightning_mp[fp8]" (or pip install torchao). Without it, leave fp8=None.'
        ) from error
    return float8


def validate_fp8(fp8: Fp8Spec, precision: str) -> Fp8Spec:
    """``fp8`` checked (a recipe name or a ``Float8LinearConfig``; torchao imported, since fp8 is set); ``None``
    passes. fp8 runs with both ``bf16-mixed`` and ``16-mixed`` (where the loss scaler works as without fp8: torchao
    scales each cast dynamically, so the loss scale cancels out of the fp8 casts).

    Raises:
        ValueError: anything else, naming the value and what is allowed.
        ImportError: torchao is missing (see :func:`import_float8`).
    """
    if fp8 is None:
        return None
    if isinstance(fp8, str):
        if fp8 not in RECIPES:
            raise ValueError(
                f"MixedPrecisionPlugin(fp8={fp8!r}) is not a torchao float8 recipe: use one of {list(RECIPES)}, a "
                "torchao.float8.Float8LinearConfig, or None (no fp8)."
            )
        import_float8()
        return fp8
    float8 = import_float8()
    if isinstance(fp8, float8.Float8LinearConfig):
        return fp8
    raise ValueError(
        f"MixedPrecisionPlugin(fp8={fp8!r}): fp8 must be None, a recipe name {list(RECIPES)} or a "
        f"torchao.float8.Float8LinearConfig, not a {type(fp8).__name__}."
    )


def recipe_of(fp8: Fp8Spec) -> str:
    """The recipe name, or ``"custom"`` for a ``Float8LinearConfig`` given by the user."""
    return fp8 if isinstance(fp8, str) else "custom"


def fp8_mode(device: torch.device) -> str:
    """``"real"`` on a CUDA device with fp8 matmuls, ``"emulated"`` on any other non-CUDA device.

    Raises:
        RuntimeError: a CUDA device older than compute capability 8.9, naming it.
    """
    if device.type != "cuda":
        return "emulated"
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"MixedPrecisionPlugin(fp8=...) needs fp8 matmuls, which CUDA devices have from compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper, Blackwell); {device} is a {name} of compute "
            f"capability {capability[0]}.{capability[1]}. Use fp8=None (bf16-mixed) on this GPU, or a "
            "Float8LinearConfig(emulate=True) to check numerics (slow)."
        )
    return "real"


def linear_config(fp8: Fp8Recipe, device: torch.device, fsdp2: bool = False) -> tuple[Any, list[str]]:
    """The ``Float8LinearConfig`` to convert with on ``device`` and the notes to show the user.

    A recipe name becomes ``Float8LinearConfig.from_recipe_name``; a config is used as given, except that
    ``emulate`` is set off the CUDA devices that run fp8 (on CPU every fp8 matmul is emulated). Under FSDP2
    (``fsdp2=True``) tensorwise weight scaling all-gathers the weights in fp8 (``enable_fsdp_float8_all_gather``,
    the plugin precomputes their scales after every optimizer step); rowwise recipes all-gather in high precision,
    as torchao supports fp8 all-gather for tensorwise weights only.
    """
    float8 = import_float8()
    notes: list[str] = []
    mode = fp8_mode(device)
    config = float8.Float8LinearConfig.from_recipe_name(fp8) if isinstance(fp8, str) else fp8
    if mode == "emulated" and not config.emulate:
        config = dataclasses.replace(config, emulate=True)
    if mode == "emulated" or config.emulate:
        notes.append(
            f"fp8 on {device} is emulated (values rounded to fp8, matmuls in fp32): for correctness, not speed; "
            "real fp8 needs a CUDA device of compute capability >= 8.9."
        )
    if fsdp2:
        tensorwise = config.cast_config_weight.scaling_granularity is float8.config.ScalingGranularity.TENSORWISE
        if tensorwise and not config.enable_fsdp_float8_all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        if config.enable_fsdp_float8_all_gather:
            notes.append(
                "FSDP2 all-gathers the fp8 layers' weights in fp8; their scales are precomputed after "
                "every optimizer step."
            )
        else:
            notes.append(
                f"FSDP2 all-gathers the weights in high precision: torchao's fp8 all-gather needs "
                f"tensorwise weight scaling, and recipe {recipe_of(fp8)!r} is not tensorwise."
            )
    return config, notes


def fp8_dtypes(config: Any) -> dict[str, torch.dtype]:
    """The fp8 dtype of each cast (``input``, ``weight``, ``grad_output``) under ``config``."""
    return {
        "input": config.cast_config_input.target_dtype,
        "weight": config.cast_config_weight.target_dtype,
        "grad_output": config.cast_config_grad_output.target_dtype,
    }
