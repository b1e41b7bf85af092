"""The optimizer's side of lean masters (the store here and its FSDP2 form, :mod:`lightning_mp.distributed.
fsdp2_lean`): every parameter it trains belongs to the converted model, and its fp32 state survives
``load_state_dict`` (torch would cast it to the bf16 parameters' dtype). The optimizer stays on the model's bf16
parameters, so these are the two things it must be held to."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer


def stash_fp32_state(optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
    """``load_state_dict``'s pre-hook: torch's ``Optimizer.load_state_dict`` casts floating state to the parameter's
    dtype (bf16 here); keep the saved fp32 tensors, so that the post-hook puts them back exactly."""
    optimizer.__dict__["_lean_saved_state"] = dict(state_dict.get("state", {}))
    optimizer.__dict__["_lean_saved_groups"] = [list(g["params"]) for g in state_dict.get("param_groups", [])]


def restore_fp32_state(optimizer: Optimizer) -> None:
    """``load_state_dict``'s post-hook: the saved fp32 state tensors back in place of torch's bf16 casts."""
    saved = optimizer.__dict__.pop("_lean_saved_state", {})
    saved_groups = optimizer.__dict__.pop("_lean_saved_groups", [])
    for ids, group in zip(saved_groups, optimizer.param_groups):
        for index, param in zip(ids, group["params"]):
            for key, value in saved.get(index, {}).items():
                if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                    optimizer.state[param][key] = value.to(param.device, torch.float32, copy=True)


def keep_fp32_state(optimizer: Optimizer) -> list[Any]:
    """Register :func:`stash_fp32_state` and :func:`restore_fp32_state` on ``optimizer``; their handles."""
    return [
        optimizer.register_load_state_dict_pre_hook(stash_fp32_state),
        optimizer.register_load_state_dict_post_hook(restore_fp32_state),
    ]


def check_params_belong(index: int, optimizer: Optimizer, module_params: set[int], during_fit: bool = False) -> None:
    """Raise a ValueError naming the first parameter of ``optimizer`` (number ``index``) whose id is not in
    ``module_params``: lean masters hold the weights of the converted module's parameters only. ``during_fit``: the
    groups were edited after setup (checked before the backward and the step that would use them)."""
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if id(param) not in module_params:
                fix = (
                    " (put there after setup, e.g. group['params'].append(...) or item assignment). Nothing was "
                    "updated. Add the model's own parameters (optimizer.add_param_group, or group['params'] edited "
                    "with the model's parameters)"
                    if during_fit
                    else ". Build the optimizer from self.parameters() in configure_optimizers"
                )
                raise ValueError(
                    f"master_weights='remainder' needs every optimizer parameter to belong to the model, but "
                    f"optimizer {index} ({type(optimizer).__name__}) param_groups[{g}]['params'][{i}] "
                    f"(shape {tuple(param.shape)}, {param.dtype}) is not one of its parameters{fix}, or use "
                    "master_weights=False."
                )
