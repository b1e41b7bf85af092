"""The fp8 side of compare.py: the decoder workload's modes that compile the model or wire torchao by hand.

- ``fp8`` / ``fp8+compile``: ``MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")`` (the plugin converts);
- ``torchao-fp8`` / ``torchao-fp8+compile``: Lightning's built-in ``bf16-mixed`` with the layers converted by hand,
  as users do today (``convert_to_float8_training`` with the same layer filter as the plugin's default: every
  nn.Linear with dimensions that are multiples of 16 except the output projection);
- ``builtin-bf16+compile`` / ``ours-bf16+compile``: the bf16 references, compiled.

``+compile`` compiles the network (``torch.compile(net)``) before ``fit``; the plugin's conversion happens inside
the compiled module (compilation is lazy), so both fp8 paths compile the same graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FP8_MODES: dict[str, dict[str, Any]] = {
    "builtin-bf16+compile": {"precision": "bf16-mixed", "compile": True},
    "ours-bf16+compile": {"plugin": {"precision": "bf16-mixed"}, "compile": True},
    "fp8": {"plugin": {"precision": "bf16-mixed", "fp8": "tensorwise"}},
    "fp8+compile": {"plugin": {"precision": "bf16-mixed", "fp8": "tensorwise"}, "compile": True},
    "torchao-fp8": {"precision": "bf16-mixed", "torchao": "tensorwise"},
    "torchao-fp8+compile": {"precision": "bf16-mixed", "torchao": "tensorwise", "compile": True},
}
#: what the decoder workloads run by default: fp8 against ours bf16, the built-in bf16 and torchao by hand
DECODER_MODES = {
    "cuda": [
        "builtin-bf16",
        "ours-bf16",
        "fp8",
        "torchao-fp8",
        "builtin-bf16+compile",
        "ours-bf16+compile",
        "fp8+compile",
        "torchao-fp8+compile",
    ],
    "cpu": ["builtin-bf16", "ours-bf16", "fp8", "torchao-fp8", "fp8+compile"],
}


def prepare(spec: dict[str, Any], module: Any, device: str) -> None:
    """Wire torchao by hand and/or compile ``module.net`` as the mode's ``spec`` says (in place)."""
    recipe = spec.get("torchao")
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if device != "cuda":
            import dataclasses

            config = dataclasses.replace(config, emulate=True)
        linears = [name for name, m in module.net.named_modules() if type(m) is nn.Linear]
        last = linears[-1] if linears else None

        def eligible(layer: nn.Module, name: str) -> bool:
            return name != last and layer.in_features % 16 == 0 and layer.out_features % 16 == 0

        convert_to_float8_training(module.net, config=config, module_filter_fn=eligible)
        if device != "cuda":
            # Float8Linear follows CUDA's autocast only; on CPU it needs by hand what the plugin does (its input cast,
            # autocast off inside it), else evaluation under inference mode fails (aten.to.dtype on fp8 operands)
            from lightning_mp.fp8.convert import _follow_autocast

            for layer in module.net.modules():
                if type(layer).__name__ == "Float8Linear":
                    _follow_autocast(layer, device)
    if spec.get("compile"):
        module.net = torch.compile(module.net)
