"""THE table of the optimizers the lean fast paths know: one :class:`Entry` per class carries everything they need.

An entry says, for one ``torch.optim`` class: the state it keeps (the fp32 tensors shaped like the parameter, for a
group's options, and the 0-dim tensors beside them), how that state is made and what is refused, the one-pass
kernel's options (``None``: no C/Triton kernel, the chunked path only), torch's own fused or foreach function that
the chunked path runs on the reconstructed fp32 values, and the first-step rule. The chunked update
(:mod:`.chunked`), the step plan (:mod:`.plan`), the dispatch (:mod:`.update`) and the FSDP2 store read the entry
and nothing else about the class.

The lookup is by exact type (:func:`entry_for`): a subclass, any other class, or a group with
``differentiable``/``capturable`` set has no entry and goes to the generic path on purpose
(:mod:`.generic`: the optimizer's own ``step()`` on fp32 slices). Adding an optimizer is one entry here: its state
keys, its function and, when torch's function does not take ``found_inf``, ``skips_on_host=True`` (the flag is read
on the host and the whole update skipped, as ``GradScaler.step`` skips a non-fused optimizer's ``step()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.optim import SGD, Adam, AdamW, NAdam, Optimizer

from lightning_mp.kernels import native
from lightning_mp.master.following import group_index


def local_of(tensor: Tensor) -> Tensor:
    """This rank's shard of a sharded (``DTensor``) tensor, the same storage; any other tensor as it is. The update
    runs on local shards: a DTensor op here would be a collective or a reshard."""
    return getattr(tensor, "_local_tensor", tensor)


def fp32_zeros_like(param: Tensor) -> Tensor:
    """fp32 zeros shaped (and, for a DTensor, sharded) like ``param``: a new optimizer state tensor."""
    return torch.zeros_like(param, dtype=torch.float32, memory_format=torch.contiguous_format)


@dataclass(frozen=True)
class Entry:
    """What the lean update knows about one optimizer class.

    Attributes:
        keys: the fp32 state tensors shaped like the parameter that a group with these options keeps.
        scalars: the 0-dim fp32 state tensors and their initial values (``("step", 0.0)``), made with the state.
        scalars_on_param_device: the scalars are made on the parameter's device (torch's fused optimizers), else on
            the CPU (torch's foreach optimizers without ``capturable``).
        lazy: each of ``keys`` is made where it is missing or ``None`` and there are no scalars (SGD's momentum
            buffer); else the whole state is made where it is empty and a partial one is refused (Adam's rule).
        option_keys: the group options the kernel's options are made of (a plan makes them again when one changes).
        kernel: the one-pass kernel's options for a group, by the names of
            :class:`~lightning_mp.kernels.native.Options` (``kernel(group, first_step)``); ``None``: no kernel, the
            chunked path runs the update. Which options change the state's layout (``amsgrad``, SGD's momentum) is
            :data:`lightning_mp.master.following.LAYOUT_OPTIONS`.
        run: torch's function on lists of fp32 tensors: ``run(group, params, grads, tensors, scalars, lr, found,
            first_step)``, ``tensors`` one list per key, ``scalars`` one list per scalar.
        counts_steps: the caller advances ``step`` (``+= 1`` before, ``-= found`` after: torch's fused optimizers);
            else ``run`` advances its scalars itself (torch's foreach functions).
        skips_on_host: ``run`` takes no ``found_inf``: the flag is read on the host and a skipped update is not run.
        first_step: ``first_step(optimizer, group, stepped)``: whether this update is the first (SGD's momentum).
        sharded_refusal: why FSDP2's state made before the first step cannot match torch's for ``group`` (or ``None``).
    """

    keys: Callable[[dict[str, Any]], tuple[str, ...]]
    scalars: tuple[tuple[str, float], ...]
    scalars_on_param_device: bool
    lazy: bool
    option_keys: tuple[str, ...]
    kernel: Optional[Callable[[dict[str, Any], bool], dict[str, Any]]]
    run: Callable[..., None]
    counts_steps: bool
    skips_on_host: bool
    first_step: Callable[[Optimizer, dict[str, Any], list[Tensor]], bool]
    sharded_refusal: Callable[[dict[str, Any]], Optional[str]]


def _never(*_: Any) -> Any:
    return None


def _not_first(optimizer: Optimizer, group: dict[str, Any], stepped: list[Tensor]) -> bool:
    return False


# ---------------------------------------------------------------------- Adam, AdamW: torch._fused_adam(w)_
def _adam_keys(group: dict[str, Any]) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group["amsgrad"] else ("exp_avg", "exp_avg_sq")


def _adam_kernel(group: dict[str, Any], first_step: bool) -> dict[str, Any]:
    betas = group["betas"]
    return dict(
        kind=native.ADAMW if group.get("decoupled_weight_decay", False) else native.ADAM,
        amsgrad=bool(group["amsgrad"]), maximize=bool(group["maximize"]), lr=float(group["lr"]),
        beta1=float(betas[0]), beta2=float(betas[1]), weight_decay=float(group["weight_decay"]), eps=float(group["eps"]),
    )  # fmt: skip


def _adam_run(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], tensors: list[list[Tensor]],
              scalars: list[list[Tensor]], lr: Any, found: Any, first_step: bool) -> None:  # fmt: skip
    """``torch._fused_adamw_`` / ``_fused_adam_``, as ``torch.optim.AdamW/Adam(fused=True)`` calls it."""
    fused = torch._fused_adamw_ if group.get("decoupled_weight_decay", False) else torch._fused_adam_
    amsgrad = group["amsgrad"]
    fused(
        params, grads, tensors[0], tensors[1], tensors[2] if amsgrad else [], scalars[0], amsgrad=amsgrad, lr=lr,
        beta1=float(group["betas"][0]), beta2=float(group["betas"][1]), weight_decay=group["weight_decay"],
        eps=group["eps"], maximize=group["maximize"], grad_scale=None, found_inf=found,
    )  # fmt: skip


ADAM = Entry(
    keys=_adam_keys,
    scalars=(("step", 0.0),),
    scalars_on_param_device=True,
    lazy=False,
    option_keys=("lr", "betas", "weight_decay", "eps", "amsgrad", "maximize", "decoupled_weight_decay"),
    kernel=_adam_kernel,
    run=_adam_run,
    counts_steps=True,
    skips_on_host=False,
    first_step=_not_first,
    sharded_refusal=_never,
)


# ---------------------------------------------------------------------- SGD: torch._fused_sgd_
def _sgd_keys(group: dict[str, Any]) -> tuple[str, ...]:
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _sgd_kernel(group: dict[str, Any], first_step: bool) -> dict[str, Any]:
    return dict(
        kind=native.SGD, maximize=bool(group["maximize"]), nesterov=bool(group["nesterov"]),
        first_step=bool(first_step), lr=float(group["lr"]), weight_decay=float(group["weight_decay"]),
        momentum=float(group["momentum"]), dampening=float(group["dampening"]),
    )  # fmt: skip


def _sgd_run(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], tensors: list[list[Tensor]],
             scalars: list[list[Tensor]], lr: Any, found: Any, first_step: bool) -> None:  # fmt: skip
    """``torch._fused_sgd_``, as ``torch.optim.SGD(fused=True)`` calls it."""
    torch._fused_sgd_(
        params, grads, tensors[0] if tensors else [], weight_decay=group["weight_decay"], momentum=group["momentum"],
        lr=lr, dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
        is_first_step=first_step, grad_scale=None, found_inf=found,
    )  # fmt: skip


def _sgd_first_step(optimizer: Optimizer, group: dict[str, Any], stepped: list[Tensor]) -> bool:
    """torch.optim.SGD(fused=True)'s first step (no momentum buffers yet) copies the gradient in."""
    return group["momentum"] != 0 and all(optimizer.state[p].get("momentum_buffer") is None for p in stepped)


def _sgd_sharded_refusal(group: dict[str, Any]) -> Optional[str]:
    """A zero momentum buffer made before the first step matches torch's first step (a copy of the gradient) only
    without dampening, which would scale it."""
    return "SGD with dampening" if group.get("dampening", 0) != 0 else None


SGD_ENTRY = Entry(
    keys=_sgd_keys,
    scalars=(),
    scalars_on_param_device=True,
    lazy=True,
    option_keys=("lr", "weight_decay", "momentum", "dampening", "nesterov", "maximize"),
    kernel=_sgd_kernel,
    run=_sgd_run,
    counts_steps=False,
    skips_on_host=False,
    first_step=_sgd_first_step,
    sharded_refusal=_sgd_sharded_refusal,
)


# ---------------------------------------------------------------------- NAdam: torch.optim.nadam's foreach function
def _nadam_run(group: dict[str, Any], params: list[Tensor], grads: list[Tensor], tensors: list[list[Tensor]],
               scalars: list[list[Tensor]], lr: Any, found: Any, first_step: bool) -> None:  # fmt: skip
    """``torch.optim.nadam._multi_tensor_nadam``, as ``torch.optim.NAdam(foreach=True)`` calls it."""
    from torch.optim.nadam import _multi_tensor_nadam

    _multi_tensor_nadam(
        params, grads, tensors[0], tensors[1], scalars[1], scalars[0], beta1=float(group["betas"][0]),
        beta2=float(group["betas"][1]), lr=lr, weight_decay=group["weight_decay"],
        momentum_decay=group["momentum_decay"], eps=group["eps"],
        decoupled_weight_decay=group["decoupled_weight_decay"], maximize=group["maximize"], capturable=False,
        differentiable=False, has_complex=False,
    )  # fmt: skip


NADAM = Entry(
    keys=lambda group: ("exp_avg", "exp_avg_sq"),
    scalars=(("step", 0.0), ("mu_product", 1.0)),
    scalars_on_param_device=False,
    lazy=False,
    option_keys=(),
    kernel=None,
    run=_nadam_run,
    counts_steps=False,
    skips_on_host=True,
    first_step=_not_first,
    sharded_refusal=_never,
)


#: Optimizer class (exact type) -> its entry. Anything else goes to the generic path (:mod:`.generic`).
TABLE: dict[type, Entry] = {AdamW: ADAM, Adam: ADAM, SGD: SGD_ENTRY, NAdam: NADAM}


def entry_for(optimizer: Optimizer) -> Optional[Entry]:
    """``optimizer``'s entry: by its exact type, ``None`` for any other class or subclass, and for groups with
    ``differentiable`` or ``capturable`` set (those go to the generic path, on purpose)."""
    entry = TABLE.get(type(optimizer))
    if entry is None or any(g.get("differentiable") or g.get("capturable") for g in optimizer.param_groups):
        return None
    return entry


def names() -> str:
    """The classes of the table, by name (for messages)."""
    return ", ".join(f"torch.optim.{cls.__name__}" for cls in TABLE)


# ---------------------------------------------------------------------- the state: made and refused by the entry
def state_for(entry: Entry, optimizer: Optimizer, param: Tensor, group: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state[param]`` as the entry's update reads it, made as torch makes it where it is empty (fp32
    zeros shaped, and for a DTensor sharded, like the parameter; the scalars' initial values) and checked. A lazy
    entry without keys (SGD without momentum) keeps no state: an empty dict, ``optimizer.state`` untouched."""
    keys = entry.keys(group)
    if entry.lazy:
        if not keys:
            return {}
        state = optimizer.state[param]
        for key in keys:
            if state.get(key) is None:
                # zeros, not torch's empty_like: a first step skipped by found_inf leaves defined values behind
                state[key] = fp32_zeros_like(param)
            check_state_tensor(optimizer, param, key, state[key])
        return state
    state = optimizer.state[param]
    if not state:
        device = param.device if entry.scalars_on_param_device else torch.device("cpu")
        for name, value in entry.scalars:
            state[name] = torch.tensor(value, dtype=torch.float32, device=device)
        for key in keys:
            state[key] = fp32_zeros_like(param)
    check_state(entry, optimizer, param, state, group)
    return state


def check_state(
    entry: Entry, optimizer: Optimizer, param: Tensor, state: dict[str, Any], group: dict[str, Any]
) -> None:
    """Refuse, by name, a state that holds some of the entry's keys and scalars but not all (torch's Adam raises
    ``KeyError`` there too; a lazy entry's missing or ``None`` key is made from the gradient), and state tensors
    :func:`check_state_tensor` refuses."""
    keys = entry.keys(group)
    if entry.lazy:
        for key in keys:
            if state.get(key) is not None:
                check_state_tensor(optimizer, param, key, state[key])
        return
    for key in (*keys, *(name for name, _ in entry.scalars)):
        if key not in state:
            raise KeyError(
                f"{type(optimizer).__name__}.state[param] of a parameter of shape {tuple(param.shape)} holds "
                f"{sorted(state)} but not {key!r}: torch's {type(optimizer).__name__} makes a parameter's state only "
                "where it is empty, so a partly cleared state stops its step too. Nothing was updated. Clear the "
                "whole state (optimizer.state[param].clear()) or give it every key."
            )
    for key in keys:
        check_state_tensor(optimizer, param, key, state[key])


def check_states(optimizer: Optimizer, groups: list[dict[str, Any]], stepped: Callable[[Tensor], bool]) -> None:
    """:func:`check_state` for every parameter of ``groups`` that ``stepped`` and has state (an empty one is made at
    its update), before any of them is updated: the chunked path updates group by group (and, inside backward,
    parameter by parameter), so a state met later would stop the step half-way."""
    entry = entry_for(optimizer)
    if entry is None:
        return
    for group in groups:
        if entry.lazy and not entry.keys(group):
            continue
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and stepped(param):
                check_state(entry, optimizer, param, state, group)


def check_state_tensor(optimizer: Optimizer, param: Tensor, key: str, value: Any) -> None:
    """Refuse, by name, optimizer state that the update cannot read as torch's fused kernel reads fp32 state: a
    tensor that is not fp32, not shaped like the parameter, on another device, or not contiguous (a user's
    ``state[p]["exp_avg"] = torch.zeros_like(p)`` makes a bf16 one: lean masters keep fp32 state)."""
    local, target = local_of(value) if isinstance(value, Tensor) else value, local_of(param)
    if (
        isinstance(local, Tensor)
        and local.dtype == torch.float32
        and local.shape == target.shape
        and local.device == target.device
        and local.is_contiguous()
    ):
        return
    what = (
        f"{local.dtype} tensor of shape {tuple(local.shape)} on {local.device}"
        + ("" if local.is_contiguous() else ", not contiguous")
        if isinstance(local, Tensor)
        else repr(type(value).__name__)
    )
    index = group_index(optimizer, param)
    raise ValueError(
        f"master_weights='remainder': {type(optimizer).__name__}.state[param][{key!r}] of a parameter of shape "
        f"{tuple(param.shape)} in param_groups[{index if index is not None else '?'}] is a {what}; the lean update keeps optimizer state in fp32, "
        f"contiguous, shaped and placed like the parameter ({tuple(target.shape)} on {target.device}), as torch's "
        f"fused optimizer reads it. Nothing was updated. Assign fp32 state, e.g. "
        f"torch.zeros_like(state[{key!r}]) or torch.zeros_like(param, dtype=torch.float32), not "
        "torch.zeros_like(param) (bf16)."
    )


def initial_state(optimizer: Optimizer) -> None:
    """Make the state of every trainable parameter that has none, as the entry's first update would (FSDP2: a
    distributed-checkpoint load must find the optimizer initialised, or torch's ``_init_optim_state`` runs a step on
    the bf16 parameters and makes bf16 state). A lazy entry's buffer starts at zero: its first update,
    ``0 * momentum + grad``, is the gradient bit for bit, as torch's first step (a copy) makes it."""
    entry = entry_for(optimizer)
    if entry is None:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad and not optimizer.state.get(param):
                optimizer.state[param]  # an entry for every parameter, also one that keeps no state (plain SGD)
                state_for(entry, optimizer, param, group)
