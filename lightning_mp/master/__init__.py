"""Master weights: the model runs in fp16/bf16 while the optimizer updates exact higher-precision values.

- :mod:`lightning_mp.master.flat`: :class:`MasterWeights`, fp32 masters in one flat buffer per device
  (``master_weights=True`` or ``"fp32"``).
- :mod:`lightning_mp.master.lean`: :class:`RemainderMasters`, a bf16 model plus a 16-bit remainder per
  element, exact fp32 masters without an fp32 copy (``master_weights="remainder"``), beside :class:`MasterWeights`
  (both implement the weights interface, :mod:`lightning_mp.master.plain`; their small common base is
  :mod:`lightning_mp.master.converted`); its update is :mod:`lightning_mp.master.lean.update`'s (the optimizers of
  its table, :mod:`~lightning_mp.master.lean.optimizers`, in one pass or chunk by chunk, any other on fp32 slices);
  the weights and remainders live in blocks built and released one at a time (:mod:`~lightning_mp.master.lean.blocks`).
- :mod:`lightning_mp.master.exact`: the exact fp32 weights for code that reads or writes the model between steps
  (EMA teachers, weight averaging; :mod:`lightning_mp.averaging` adapts Lightning's callbacks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from lightning_mp.master.converted import NORM_TYPES, ConvertedModel, is_norm
from lightning_mp.master.exact import NotHeldError, exact_parameters, exact_weights
from lightning_mp.master.flat import MasterWeights
from lightning_mp.master.lean import RemainderMasters
from lightning_mp.master.plain import PlainWeights

__all__ = [
    "MasterWeights",
    "NORM_TYPES",
    "NotHeldError",
    "PlainWeights",
    "RemainderMasters",
    "exact_parameters",
    "exact_weights",
    "is_norm",
    "masters_for",
]

#: What ``MixedPrecisionPlugin(master_weights=...)`` takes (a store built yourself is accepted too).
MasterWeightsOption = Union[bool, str, dict[str, Any], None]

_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def masters_for(
    dtype: torch.dtype,
    master_weights: Union[MasterWeightsOption, PlainWeights],
    keep_fp32: Callable[[str, nn.Module], bool] = is_norm,
) -> Optional[PlainWeights]:
    """The master-weights store for the plugin's ``master_weights`` argument.

    ``False``/``None``: none (the model stays fp32). ``True`` or ``"fp32"``: :class:`MasterWeights` (fp32 copies,
    whose gradients the model shows: ``show_grads=True``).
    ``"remainder"``: :class:`RemainderMasters` (bf16 only). A mapping (YAML) ``{"kind": "remainder", "chunk_size":
    ..., "accumulate_grads_in": "bf16", "compile": True}`` passes its other keys to :class:`RemainderMasters`. A
    store you built yourself is used as it is.

    Raises:
        ValueError: any other value, or ``"remainder"`` with fp16 (with the reason and what to use).
    """
    if isinstance(master_weights, ConvertedModel):
        return master_weights
    if master_weights is None or master_weights is False:
        return None
    if master_weights is True or master_weights == "fp32":
        return MasterWeights(dtype, keep_fp32=keep_fp32, show_grads=True)  # the plugin follows the shown gradients
    if master_weights == "remainder":
        return RemainderMasters(dtype, keep_fp32=keep_fp32)
    if isinstance(master_weights, Mapping) and master_weights.get("kind") == "remainder":
        options = {k: v for k, v in master_weights.items() if k != "kind"}
        unknown = sorted(set(options) - {"chunk_size", "accumulate_grads_in", "compile"})
        if unknown:
            raise ValueError(
                f"master_weights={dict(master_weights)!r}: unknown key(s) {unknown}; allowed: 'kind', 'chunk_size', "
                "'accumulate_grads_in', 'compile'."
            )
        accumulate = options.get("accumulate_grads_in", torch.float32)
        if isinstance(accumulate, str):
            if accumulate.lower().removeprefix("torch.") not in _DTYPE_NAMES:
                raise ValueError(
                    f"master_weights accumulate_grads_in={accumulate!r}: use one of {sorted(_DTYPE_NAMES)}."
                )
            accumulate = _DTYPE_NAMES[accumulate.lower().removeprefix("torch.")]
        chosen = {k: options[k] for k in ("chunk_size", "compile") if k in options}
        return RemainderMasters(dtype, keep_fp32=keep_fp32, accumulate_grads_in=accumulate, **chosen)
    raise ValueError(
        f"master_weights={master_weights!r} is not supported: use False (no masters, fp32 model), True or 'fp32' "
        "(fp32 master copies), 'remainder' (bf16 weights + 16-bit remainders, bf16-mixed only), or a mapping "
        "{'kind': 'remainder', 'chunk_size': ..., 'accumulate_grads_in': 'fp32' | 'bf16'}."
    )
