"""Run LitGPT's own recipes (``finetune_full``, ``finetune_lora``, ``finetune_adapter``, ...) with the plugin.

    python examples/litgpt_recipes.py --master-weights remainder finetune_full CHECKPOINT_DIR \\
        --data JSON --data.json_path data.json --train.max_steps 100
    python examples/litgpt_recipes.py --optimizer-in-backward finetune_full CHECKPOINT_DIR ...   # 12 bytes/param

Every argument after the recipe's name is LitGPT's own (``litgpt finetune_full --help``). LitGPT's CLI builds its own
``L.Fabric(precision=...)`` and has no plugin flag; in this process the runner makes every ``lightning.Fabric`` that
LitGPT builds carry ``MixedPrecisionPlugin`` instead of LitGPT's precision: ``--master-weights remainder`` (bf16
weights + 16-bit remainders, the default), ``true`` (fp32 master copies) or ``false`` (autocast and the inf/NaN check
only); ``--optimizer-in-backward`` adds ``optimizer_in_backward=True`` (with ``remainder``: each parameter updated
inside ``fabric.backward`` and its gradient freed; one backward per step, so ``--train.global_batch_size`` equal to
``--train.micro_batch_size``). LitGPT's ``--precision`` picks the autocast dtype: ``bf16-*`` (or none) gives ``bf16-mixed``, ``16-*`` gives
``16-mixed`` (with ``--master-weights true`` or ``false``). LitGPT loads its checkpoint after ``fabric.setup``
(``model.load_state_dict(lazy_load(path))``): the masters take the loaded fp32 values exactly (docs/master-weights.md,
"Writes after setup").

LitGPT's ``pretrain`` runs the same way (its text data modules need ``litdata``: the ``litgpt`` extra), but not with
``--optimizer-in-backward``: it clips by norm every step and refuses ``--train.max_norm`` unset, and a step inside
backward has no whole gradient to clip; the runner refuses that pair before anything runs. At start the runner prints
one line naming the plugin LitGPT's Fabric carries and its options.

In your own code, call a recipe's ``main(fabric, ...)`` with a Fabric you built with the plugin (tests/
test_litgpt_recipes.py and tests/test_litgpt_pretrain.py do). Limits: one device (LitGPT picks FSDP1 for several,
which the plugin refuses); no ``--quantize`` (it brings its own precision plugin). See docs/litgpt.md.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import lightning

from lightning_mp import MixedPrecisionPlugin

MASTER_WEIGHTS = {"remainder": "remainder", "true": True, "false": False}
_FABRIC = lightning.Fabric


class PluginFabric(_FABRIC):  # type: ignore[misc, valid-type]
    """``lightning.Fabric`` with ``MixedPrecisionPlugin`` in place of the ``precision`` it is given."""

    master_weights: Any = "remainder"
    optimizer_in_backward: bool = False
    last_plugin: Optional[MixedPrecisionPlugin] = None

    def __init__(self, *args: Any, precision: Any = None, plugins: Any = None, **kwargs: Any) -> None:
        if plugins:
            raise SystemExit(f"litgpt_recipes.py: LitGPT passed its own plugins ({plugins!r}, --quantize): drop it.")
        name = str(precision or "bf16-mixed")
        if not name.startswith(("bf16", "16")):
            raise SystemExit(f"litgpt_recipes.py: --precision {name} has no mixed-precision plugin: use bf16-mixed.")
        plugin = MixedPrecisionPlugin(
            "16-mixed" if name.startswith("16") else "bf16-mixed",
            master_weights=type(self).master_weights,
            optimizer_in_backward=type(self).optimizer_in_backward,
        )
        PluginFabric.last_plugin = plugin
        print(f"lightning_mp: {plugin!r}", flush=True)  # the one line that says which plugin LitGPT's Fabric carries
        super().__init__(*args, plugins=[plugin], **kwargs)


def main(argv: Optional[list[str]] = None) -> None:
    """``argv`` (default ``sys.argv[1:]``): ``[--master-weights remainder|true|false] [--optimizer-in-backward] RECIPE
    [LitGPT's arguments]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    master_weights, in_backward = "remainder", False
    while args and args[0].startswith(("--master-weights", "--optimizer-in-backward")):
        option = args.pop(0)
        if option == "--optimizer-in-backward":
            in_backward = True
        else:
            master_weights = option.split("=", 1)[1] if "=" in option else args.pop(0)
    if master_weights.lower() not in MASTER_WEIGHTS:
        raise SystemExit(f"--master-weights {master_weights!r}: use one of {sorted(MASTER_WEIGHTS)}.")
    if in_backward and args[:1] == ["pretrain"]:  # refused here, before LitGPT tokenizes data or builds a model
        raise SystemExit(
            "litgpt_recipes.py: --optimizer-in-backward cannot run pretrain: LitGPT's pretrain clips gradients by norm "
            "every step (--train.max_norm is required) and a step inside backward has no whole gradient to clip; run "
            "pretrain without --optimizer-in-backward, or use it with finetune_full, finetune_lora or finetune_adapter."
        )
    PluginFabric.master_weights = MASTER_WEIGHTS[master_weights.lower()]
    PluginFabric.optimizer_in_backward = in_backward
    from litgpt.__main__ import main as litgpt_main

    saved_argv = sys.argv
    sys.argv = ["litgpt", *args]  # LitGPT's CLI (and its save_hyperparameters) read sys.argv
    lightning.Fabric = PluginFabric  # LitGPT's recipes build lightning.Fabric(...) when they run
    try:
        litgpt_main()
    finally:
        lightning.Fabric = _FABRIC
        sys.argv = saved_argv


if __name__ == "__main__":
    main()
