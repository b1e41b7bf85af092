"""Lightning callbacks that master weights cannot run with, refused when the plugin connects (before any step).

- ``BaseFinetuning`` (``BackboneFinetuning``) with ``master_weights=True``: it names each parameter of each param
  group by the module's names at every epoch start, and the groups hold fp32 masters there (a ``KeyError`` deep
  inside the callback otherwise). Lean masters keep the model's parameters in the groups: it runs.
- ``ModelPruning`` with any master weights: ``torch.nn.utils.prune`` re-registers each pruned weight as
  ``<name>_orig`` with a ``<name>_mask`` buffer and recomputes ``<name>`` from them in a forward pre-hook, and makes
  it permanent with ``p.data = orig * mask``: the exact fp32 weights (held outside the model) cannot follow the mask
  nor the permanent weights exactly. A pruning call elsewhere (``prune.*`` in a user's hook) is refused at the next
  step, by the model sync (:data:`PRUNING`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

#: What to do about pruning under master weights (quoted by the refusal at connect and by the model sync's).
PRUNING = (
    "torch.nn.utils.prune re-registers each pruned weight as '<name>_orig' with a '<name>_mask' buffer and "
    "recomputes the weight in a forward pre-hook; the master weights (the exact fp32 weights, held outside the "
    "model) cannot follow that. Train with master_weights=False (autocast over the fp32 model: ModelPruning and "
    "torch.nn.utils.prune work as with Lightning's built-in bf16-mixed), or prune the fp32 model before fit or "
    "after it (the plugin gives the model back its exact fp32 weights at the end of fit)."
)


def refuse_callbacks(callbacks: Iterable[Any], option: Any, reads_groups: bool) -> None:
    """Raise a ``ValueError`` for the first callback in ``callbacks`` that ``master_weights=option`` cannot run with;
    ``reads_groups``: the optimizer's groups hold fp32 masters instead of the model's parameters."""
    for callback in callbacks:
        names = {cls.__name__ for cls in type(callback).__mro__}
        if reads_groups and "BaseFinetuning" in names:
            raise ValueError(
                f"master_weights=True cannot run with {type(callback).__name__}: it maps the optimizer's "
                "parameters to the module's names, and master_weights=True puts fp32 masters in the optimizer "
                "instead. Use master_weights='remainder' (bf16-mixed: the optimizer keeps the model's parameters "
                "and follows the groups the callback adds), or add the param groups in your own callback."
            )
        if "ModelPruning" in names:
            raise ValueError(
                f"MixedPrecisionPlugin(master_weights={option!r}) cannot run with {type(callback).__name__} "
                f"(pruning): {PRUNING}"
            )
