"""Ways users edit an optimizer between two steps of a fit, and a Trainer run that makes one of them.

Shared by tests/test_optimizer_edits.py (one process) and tests/distributed/optimizer_edit_checks.py (2 ranks).

Each :class:`Edit` changes what torch's optimizer reads at ``step()`` (``param_groups`` and ``optimizer.state``)
through one route, at one or more global steps, in ``on_train_batch_start`` (between two steps, before the forward:
the step inside backward has not begun either). It acts on what the optimizer holds (``param_groups[i]["params"]``:
the model's parameters, or fp32 masters with ``master_weights=True``), so one edit means the same change in every
mode. :func:`fit` runs a small MLP under a mode and returns the exact fp32 weights, the state per parameter name, the
checkpoint's optimizer state (``optimizer.state_dict()``) or, when the fit raised, the error and whether the weights
and state were left as they were when the step began.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.master.lean.generic import leaves_of
from tests.helpers import saved_copy

STEPS = 4
#: the model's width per optimizer: 64 for torchao's AdamW8bit, whose moments are 8-bit for tensors of 4096 elements
#: and more (the 64x64 weights; the rest fp32)
WIDTH = {"adamw": 16, "sgd": 16, "adamw8bit": 64}
#: the global step of most edits (earlier steps made the state and the plans)
AT = 2

# ---------------------------------------------------------------------------------------------------- the model


class EditNet(L.LightningModule):
    """Linear (lean) -> LayerNorm (kept fp32) -> Tanh -> Linear, + a residual ``extra`` Linear that is frozen and
    outside the optimizer until an edit adds it, -> ``head`` Linear. Two param groups: the body (lr 1e-2) and the
    head (its own lr and weight decay)."""

    def __init__(self, optimizer: str, edit: Optional[Edit] = None, rebuild: bool = False) -> None:
        super().__init__()
        width = WIDTH[optimizer]
        self.net = nn.Sequential(nn.Linear(8, width), nn.LayerNorm(width), nn.Tanh(), nn.Linear(width, width))
        self.extra = nn.Linear(width, width)
        self.extra.requires_grad_(False)
        self.head = nn.Linear(width, 1)
        self.optimizer_name, self.edit, self.rebuild = optimizer, edit, rebuild
        self.memo: dict[str, Any] = {}  # what an edit keeps between its steps (a deepcopy taken earlier)
        self.before: Optional[dict[str, Any]] = None  # weights and state at the start of the edited step

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.net(x)
        return self.head(hidden + self.extra(hidden))

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> Any:
        groups = [{"params": list(self.net.parameters())}, {"params": list(self.head.parameters())}]
        if self.optimizer_name == "adamw":
            groups[1].update(lr=3e-2, weight_decay=0.01)
            return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=True)
        if self.optimizer_name == "adamw8bit":  # torchao's: 8-bit moments of the 64x64 weights, fp32 of the rest
            from torchao.optim import AdamW8bit

            groups[1].update(lr=3e-2, weight_decay=0.01)
            return AdamW8bit(groups, lr=1e-2, weight_decay=0.1)
        groups[1].update(lr=3e-2, weight_decay=1e-3)
        # not fused: torch's fused SGD cannot step a group where some momentum buffers exist and others not (a
        # parameter added or reset), its for-loop SGD can (the lean step, which is bitwise the fused kernel, can too)
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        step = self.trainer.global_step
        if self.edit is not None and step in self.edit.steps:
            self.edit.steps[step](self.trainer.optimizers[0], self)
            self.before = snapshot(self.trainer.precision_plugin, self, self.trainer.optimizers[0])

    def on_before_backward(self, loss: Tensor) -> None:
        if self.rebuild:  # the reference: every step plan made again from what the optimizer holds now
            masters = self.trainer.precision_plugin.masters
            masters.step_plans.clear()
            step = masters.updates.of(self.trainer.optimizers[0]).generic
            if step is not None:  # torchao's 8-bit step in one pass: its layouts made again too
                step.follow_groups()


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS, 8, generator=generator)
    y = torch.tanh(x[:, :1] - 2 * x[:, 1:2]) + 0.1 * torch.randn(8 * STEPS, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=8)


# ---------------------------------------------------------------------------------------------------- the edits


def _params(optimizer: torch.optim.Optimizer, group: Optional[int] = None) -> list[Tensor]:
    groups = optimizer.param_groups if group is None else [optimizer.param_groups[group]]
    return [p for g in groups for p in g["params"]]


def _each_state(optimizer: torch.optim.Optimizer, group: Optional[int] = None) -> Iterator[dict[str, Any]]:
    for param in _params(optimizer, group):
        yield optimizer.state[param]


def _quantized(tensor: Any) -> bool:
    """torchao's 8-bit state (a wrapper subclass without ``clone``, ``zeros_like``, ``mul`` or ``zero_``: the edits
    below make it with ``copy_``, which quantizes, as a user must)."""
    return isinstance(tensor, Tensor) and type(tensor) is not Tensor and hasattr(tensor, "dequantize")


def _filled(like: Tensor, values: Tensor) -> Tensor:
    """A new 8-bit state of ``like``'s layout holding ``values`` quantized."""
    new = saved_copy(like)
    new.copy_(values)
    return new


def _zeros_like(tensor: Tensor) -> Tensor:
    return _filled(tensor, torch.zeros(tensor.shape)) if _quantized(tensor) else torch.zeros_like(tensor)


def _moment(optimizer: torch.optim.Optimizer) -> str:
    return "momentum_buffer" if isinstance(optimizer, torch.optim.SGD) else "exp_avg"


def _unfrozen_extra(model: EditNet) -> list[Tensor]:
    model.extra.requires_grad_(True)
    return list(model.extra.parameters())


@dataclass
class Edit:
    """A change of what the optimizer reads: ``steps`` maps a global step to ``change(optimizer, model)``, run
    before that step. ``follows``: torch's own optimizer follows it (the expected result is the reference's, bitwise);
    ``False``: torch's optimizer cannot step after it (a ``KeyError``, a shape or dtype mismatch), and the expected
    result is a loud error before any update of that step. ``optimizers``: where the edit means something."""

    name: str
    steps: dict[int, Callable[[torch.optim.Optimizer, EditNet], None]]
    follows: bool = True
    optimizers: tuple[str, ...] = ("adamw", "sgd", "adamw8bit")
    modes: Optional[tuple[str, ...]] = None  # None: every mode
    notes: str = field(default="")


#: the edits of Adam's state and options: torch's AdamW and torchao's AdamW8bit
ADAM = ("adamw", "adamw8bit")


def _at(change: Callable[[torch.optim.Optimizer, EditNet], None], step: int = AT) -> dict[int, Any]:
    return {step: change}


def _assign(key: str, make: Callable[[Tensor], Tensor], group: Optional[int] = None) -> Callable[..., None]:
    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        key_ = _moment(optimizer) if key == "moment" else key
        for state in _each_state(optimizer, group):
            state[key_] = make(state[key_])

    return change


def _assign_like_param(key: str) -> Callable[..., None]:
    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        for param in _params(optimizer):
            optimizer.state[param][_moment(optimizer) if key == "moment" else key] = torch.zeros_like(param)

    return change


def _reset(how: str, group: Optional[int] = None, only_first: bool = False) -> Callable[..., None]:
    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        params = _params(optimizer, group)[:1] if only_first else _params(optimizer, group)
        for param in params:
            if how == "new dict":
                optimizer.state[param] = {}
            elif how == "clear":
                optimizer.state[param].clear()
            elif how == "outer pop, setdefault":  # the dict leaves and an empty one comes back: same count
                optimizer.state.pop(param)
                optimizer.state.setdefault(param, {})
            elif how == "clear, setdefault step":  # a state with a step count and no moments
                optimizer.state[param].clear()
                optimizer.state[param].setdefault("step", torch.tensor(0.0))
            else:
                raise ValueError(how)

    return change


def _update_state(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
    for state in _each_state(optimizer):
        state.update({key: _scaled(0.5)(value) for key, value in state.items() if key != "step" and value is not None})


def _pop(key: str, group: int) -> Callable[..., None]:
    """``state[p].pop(key)`` for the parameters of ``group``: of the last group (the normal step updates the others
    first) or of the first (the head's gradients come first in backward: the step inside backward updates it first)."""

    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        for state in _each_state(optimizer, group):
            state.pop(_moment(optimizer) if key == "moment" else key)

    return change


def _in_place(how: str) -> Callable[..., None]:
    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        for state in _each_state(optimizer):
            tensor = state[_moment(optimizer)]
            if how == "zero_":
                tensor.copy_(torch.zeros(tensor.shape)) if _quantized(tensor) else tensor.zero_()
            else:
                tensor.copy_(torch.full(tuple(tensor.shape), 0.125))

    return change


def _keep_copy(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
    model.memo["state"] = {id(p): saved_copy(optimizer.state[p]) for p in _params(optimizer)}
    model.memo["state_dict"] = saved_copy(optimizer.state_dict())


def _restore_copy(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
    for param in _params(optimizer):
        optimizer.state[param] = model.memo["state"][id(param)]


def _load_copy(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
    optimizer.load_state_dict(model.memo["state_dict"])


def _groups(how: str) -> Callable[..., None]:
    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        body, head = optimizer.param_groups[0]["params"], optimizer.param_groups[1]["params"]
        if how == "extend":
            body.extend(_unfrozen_extra(model))
        elif how == "append":
            body.append(_unfrozen_extra(model)[0])
        elif how == "del":
            optimizer.state.pop(body[0], None)  # torch's state_dict() refuses state of a parameter in no group
            del body[0]
        elif how == "del, state kept":  # the number of states stays: only the list tells
            del body[0]
        elif how == "item":
            optimizer.state.pop(body[0], None)
            body[0] = _unfrozen_extra(model)[0]
        elif how == "item, state kept":
            body[0] = _unfrozen_extra(model)[0]
        elif how == "reverse":
            body.reverse()
        elif how == "permute":
            body[:] = [body[i] for i in (3, 0, 5, 1, 4, 2)]
        elif how == "move to another group":  # the head's bias joins the body's options
            body.append(head.pop())
        elif how == "swap between groups":  # two parameters of one shape trade groups (and options)
            body[-1], head[-1] = head[-1], body[-1]
        elif how == "new list":
            optimizer.param_groups[0]["params"] = list(body) + _unfrozen_extra(model)
        elif how == "new list, same params":
            optimizer.param_groups[0]["params"] = list(body)
        elif how == "add_param_group":
            optimizer.add_param_group({"params": _unfrozen_extra(model), "lr": 5e-3})
        elif how == "remove group":
            for param in head:
                optimizer.state.pop(param, None)
            del optimizer.param_groups[1]
        elif how == "remove group, state kept":
            del optimizer.param_groups[1]
        elif how == "groups reordered":
            optimizer.param_groups.reverse()
        else:
            raise ValueError(how)

    return change


def _options(**values: Any) -> Callable[..., None]:
    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        for group in optimizer.param_groups:
            for key, value in values.items():
                if isinstance(group.get(key), Tensor):  # torchao's lr: changed in place, as LR schedulers do
                    group[key].fill_(value)
                else:
                    group[key] = value

    return change


def _scaled(factor: float) -> Callable[[Tensor], Tensor]:
    return lambda t: _filled(t, t.dequantize() * factor) if _quantized(t) else t * factor


EDITS = [
    # state tensors assigned
    Edit("state[p][moment] = zeros", _at(_assign("moment", _zeros_like))),
    Edit("state[p][moment] = moment * 0.5", _at(_assign("moment", _scaled(0.5)))),
    Edit("state[p][exp_avg_sq] = exp_avg_sq * 4", _at(_assign("exp_avg_sq", _scaled(4.0))), optimizers=ADAM),
    Edit('state[p]["step"] = tensor(1.0)', _at(_assign("step", lambda t: torch.tensor(1.0))), optimizers=ADAM),
    Edit("state[p][moment] = None", _at(_assign("moment", lambda t: None)), optimizers=("sgd",)),
    Edit("one layer's state[p][moment] = zeros", _at(_assign("moment", _zeros_like, group=1))),
    # a parameter's state reset, by every route
    Edit("state[p] = {} (one parameter)", _at(_reset("new dict", only_first=True))),
    Edit("state[p] = {} (one layer)", _at(_reset("new dict", group=1))),
    Edit("state[p] = {} (all)", _at(_reset("new dict"))),
    Edit("state[p].clear() (all)", _at(_reset("clear"))),
    Edit("state.pop(p); state.setdefault(p, {})", _at(_reset("outer pop, setdefault", group=0))),
    Edit("optimizer.state.clear()", _at(lambda o, m: o.state.clear())),
    Edit("state[p].update({...})", _at(_update_state)),
    Edit("state restored from a deepcopy", {1: _keep_copy, 3: _restore_copy}),
    Edit("optimizer.load_state_dict(saved)", {1: _keep_copy, 3: _load_copy}),
    # state tensors changed in place
    Edit("state[p][moment].zero_()", _at(_in_place("zero_"))),
    Edit("state[p][moment].copy_(t)", _at(_in_place("copy_"))),
    # param groups edited
    Edit('group["params"].extend(new)', _at(_groups("extend"))),
    Edit('group["params"].append(new)', _at(_groups("append"))),
    Edit('del group["params"][0]', _at(_groups("del"))),
    Edit('del group["params"][0] (its state kept)', _at(_groups("del, state kept"))),
    Edit('group["params"][0] = new', _at(_groups("item"))),
    Edit('group["params"][0] = new (the old state kept)', _at(_groups("item, state kept"))),
    Edit('group["params"].reverse()', _at(_groups("reverse"))),
    Edit('group["params"][:] = permutation', _at(_groups("permute"))),
    Edit("a parameter moved to another group", _at(_groups("move to another group"))),
    Edit("two parameters swap groups", _at(_groups("swap between groups"))),
    Edit('group["params"] = new list (+ new)', _at(_groups("new list"))),
    Edit('group["params"] = list(group["params"])', _at(_groups("new list, same params"))),
    Edit("add_param_group", _at(_groups("add_param_group"))),
    Edit("del optimizer.param_groups[1]", _at(_groups("remove group"))),
    Edit("del optimizer.param_groups[1] (its state kept)", _at(_groups("remove group, state kept"))),
    Edit("optimizer.param_groups.reverse()", _at(_groups("groups reordered"))),
    # another optimizer
    Edit(
        "trainer.strategy.setup_optimizers(trainer)", _at(lambda o, m: m.trainer.strategy.setup_optimizers(m.trainer))
    ),
    # options
    Edit("lr changed", _at(_options(lr=2e-3))),
    Edit("weight_decay changed", _at(_options(weight_decay=0.3))),
    Edit("betas changed", _at(_options(betas=(0.8, 0.95))), optimizers=ADAM),
    Edit("eps and maximize changed", _at(_options(eps=1e-4, maximize=True)), optimizers=ADAM),
    Edit("amsgrad switched on over existing state", _at(_options(amsgrad=True)), follows=False, optimizers=ADAM),
    Edit("momentum off, then on again", {1: _options(momentum=0.0), 3: _options(momentum=0.9)}, optimizers=("sgd",)),
    Edit("nesterov and dampening changed", _at(_options(nesterov=True, dampening=0.0)), optimizers=("sgd",)),
    # what torch's optimizer cannot step after: refused, before any update
    Edit("state[p].pop(moment) (the last group)", _at(_pop("moment", 1)), follows=False, optimizers=ADAM),
    Edit("state[p].pop(moment) (the first group)", _at(_pop("moment", 0)), follows=False, optimizers=ADAM),
    Edit(
        "state[p].clear(); setdefault('step', ...)",
        _at(_reset("clear, setdefault step", group=1)),
        follows=False,
        optimizers=ADAM,
    ),
]
BY_NAME = {edit.name: edit for edit in EDITS}


# ---------------------------------------------------------------------------------------------------- runs

#: mode -> (master_weights, optimizer_in_backward, LIGHTNING_MP_NATIVE, rebuild the step plans before every step)
MODES: dict[str, tuple[Any, bool, Optional[str], bool]] = {
    "lean": ("remainder", False, None, False),
    "lean, plans rebuilt": ("remainder", False, None, True),
    "in backward": ("remainder", True, None, False),
    "in backward, plans rebuilt": ("remainder", True, None, True),
    "chunked": ("remainder", False, "0", False),
    "chunked in backward": ("remainder", True, "0", False),
    "True": (True, False, None, False),
    "bf16-mixed": (False, False, None, False),  # the reference of True: the optimizer steps fp32 parameters
}


#: the reference of a mode under torchao's AdamW8bit: the one-pass step with its layouts (and plans) made again before
#: every backward. Its chunked (generic) path keys the state by proxies of slices (master/lean/generic.py), so an edit
#: of ``optimizer.state[param]`` finds nothing to edit there.
REFERENCE = {"adamw8bit": "lean, plans rebuilt"}


def eight_bit_runs() -> bool:
    """Whether torchao is installed and the one-pass 8-bit step runs here (its C kernel built)."""
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return False
    from lightning_mp.kernels import adam8bit

    return adam8bit.cpu_kernel() is not None


@contextmanager
def native_env(value: Optional[str]) -> Iterator[None]:
    """``LIGHTNING_MP_NATIVE`` set to ``value`` (``None``: as it was), read per call by the store."""
    old = os.environ.get("LIGHTNING_MP_NATIVE")
    if value is not None:
        os.environ["LIGHTNING_MP_NATIVE"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIGHTNING_MP_NATIVE", None)
        else:
            os.environ["LIGHTNING_MP_NATIVE"] = old


def exact_weights(plugin: Any, model: nn.Module) -> dict[str, Tensor]:
    """The fp32 value of every parameter of ``model`` now (masters' or joined lean values; the parameter itself)."""
    masters = plugin.masters
    out = {}
    for name, param in model.named_parameters():
        value = masters.fp32_value(param) if masters is not None and param.dtype != torch.float32 else param.detach()
        out[name] = value.detach().clone()
    return out


def _copy_of(value: Tensor) -> Tensor:
    return saved_copy(value) if _quantized(value) else value.detach().clone()


def named_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, dict[str, Any]]:
    """``optimizer.state`` by parameter name (``names``: id -> name of the parameters or masters it holds)."""
    out = {}
    for param, state in optimizer.state.items():
        out[names.get(id(param), f"unknown {tuple(param.shape)}")] = {
            key: _copy_of(value) if isinstance(value, Tensor) else value for key, value in state.items()
        }
    return out


def _names(plugin: Any, model: nn.Module) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    masters = plugin.masters
    if masters is not None:
        for param, master in masters.pairs():
            names[id(master)] = names[id(param)]
    return names


def snapshot(plugin: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"weights": exact_weights(plugin, model), "state": named_state(optimizer, _names(plugin, model))}


def fit(mode: str, optimizer: str, edit: Optional[Edit], steps: int = STEPS, **trainer_kw: Any) -> dict[str, Any]:
    """One seeded fit of :class:`EditNet` under ``mode`` with ``edit``; see the module doc for what it returns."""
    master_weights, in_backward, native, rebuild = MODES[mode]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = EditNet(optimizer, edit, rebuild)
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=master_weights, optimizer_in_backward=in_backward)
    kw: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    kw.update(trainer_kw)
    trainer = L.Trainer(plugins=[plugin], **kw)
    result: dict[str, Any] = {"mode": mode}
    with native_env(native):
        try:
            trainer.fit(model, loader())
        except Exception as error:  # the expected outcome of some edits: what and where is checked by the caller
            result["error"] = error
    optimizer_ = trainer.optimizers[0] if trainer.optimizers else None
    # after fit (or its teardown after an error) the model holds its exact fp32 values, the optimizer its parameters
    result["weights"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    result["state"] = named_state(optimizer_, {id(p): n for n, p in model.named_parameters()})
    try:
        result["state_dict"] = saved_copy(optimizer_.state_dict())
    except KeyError as error:  # torch's own: state kept for a parameter in no group (the key is an id: not compared)
        result["state_dict"] = type(error).__name__
    result["before"] = model.before
    result["dtypes"] = {name: p.dtype for name, p in model.named_parameters()}
    return result


# ---------------------------------------------------------------------------------------------------- comparing


def difference(ours: dict[str, Any], reference: dict[str, Any]) -> Optional[str]:
    """``None`` when ``ours`` is bitwise ``reference`` (weights, state by name, checkpoint state); else what differs
    first, with the largest weight difference."""
    if ours["weights"].keys() != reference["weights"].keys():
        return "different parameters"
    largest = max(
        (float((ours["weights"][n].double() - v.double()).abs().max()) for n, v in reference["weights"].items()),
        default=0.0,
    )
    for name, value in reference["weights"].items():
        if not torch.equal(ours["weights"][name].view(torch.int32), value.view(torch.int32)):
            return f"weight {name} differs (largest weight difference {largest:.3g})"
    problem = _state_difference(ours["state"], reference["state"])
    if problem:
        return f"optimizer.state: {problem}"
    if isinstance(reference["state_dict"], str) or isinstance(ours["state_dict"], str):
        if ours["state_dict"] != reference["state_dict"]:
            return f"state_dict(): {ours['state_dict']} against {reference['state_dict']}"
        return None
    problem = _state_difference(ours["state_dict"]["state"], reference["state_dict"]["state"])
    if problem:
        return f"state_dict(): {problem}"
    options = [{k: v for k, v in g.items()} for g in ours["state_dict"]["param_groups"]]
    if options != reference["state_dict"]["param_groups"]:
        return "state_dict() param_groups differ"
    return None


def _state_difference(ours: dict[Any, Any], reference: dict[Any, Any]) -> Optional[str]:
    if ours.keys() != reference.keys():
        return f"keys {sorted(map(str, ours))} against {sorted(map(str, reference))}"
    for key, state in reference.items():
        if ours[key].keys() != state.keys():
            return f"{key}: {sorted(ours[key])} against {sorted(state)}"
        for name, value in state.items():
            mine = ours[key][name]
            if isinstance(value, Tensor):
                if not isinstance(mine, Tensor) or type(mine) is not type(value) or mine.dtype != value.dtype:
                    return f"{key}[{name!r}] differs"
                ours_, theirs = leaves_of(mine), leaves_of(value)  # torchao's 8-bit state: codes, scale, map
                if len(ours_) != len(theirs) or not all(torch.equal(a, b) for a, b in zip(ours_, theirs)):
                    return f"{key}[{name!r}] differs"
            elif mine != value:
                return f"{key}[{name!r}]: {mine!r} against {value!r}"
    return None


def unchanged_since_the_step_began(result: dict[str, Any]) -> Optional[str]:
    """``None`` when the weights and optimizer state after a refused step are those at its start."""
    before = result["before"]
    if before is None:
        return "the edit never ran"
    for name, value in before["weights"].items():
        if not torch.equal(result["weights"][name], value):
            return f"weight {name} changed"
    return _state_difference(result["state"], before["state"])


def outcome(result: dict[str, Any], reference: dict[str, Any]) -> str:
    """One word for the matrix: ``exact``, ``refused`` (an error, nothing changed), ``refused late`` (an error
    after some update), ``diverged (...)``."""
    if "error" in result:
        changed = unchanged_since_the_step_began(result)
        return "refused" if changed is None else f"refused late ({changed})"
    problem = difference(result, reference)
    return "exact" if problem is None else f"diverged ({problem})"


# ---------------------------------------------------------------------------------------------------- storage swaps


def _swap_storage(key: str) -> Callable[..., None]:
    """``tensor.data = new`` on a state tensor: the same tensor object, another storage (the old one freed unless
    someone keeps it alive). A kernel given the old address writes into freed memory."""

    def change(optimizer: torch.optim.Optimizer, model: EditNet) -> None:
        for state in _each_state(optimizer):
            tensor = state[_moment(optimizer) if key == "moment" else key]
            if _quantized(tensor):  # torchao's 8-bit state: its codes' storage
                tensor.codes.data = torch.full_like(tensor.codes, 7)
            else:
                tensor.data = torch.full_like(tensor, 0.25) if key != "step" else torch.tensor(float(tensor) - 1)
        model.memo.setdefault("garbage", []).append([torch.randn(64) for _ in range(64)])  # reuse the freed memory

    return change


#: run in a child process only (tests/test_optimizer_edits.py): a kernel that reads the addresses it laid out before
#: writes freed memory, or past the end of a smaller tensor
STORAGE_SWAPS = [
    Edit("state[p][moment] of the wrong shape", _at(_assign("moment", lambda t: torch.zeros(3))), follows=False),
    Edit(
        "state[p][moment] = zeros_like(p) (bf16 with lean masters)",
        _at(_assign_like_param("moment")),
        follows=False,
        notes="the parameter is bf16 under lean masters: a bf16 moment the fp32 update cannot take",
    ),
    Edit(
        "state[p][moment].data = t",
        {1: _swap_storage("moment"), 2: _swap_storage("moment"), 3: _swap_storage("moment")},
    ),
    Edit('state[p]["step"].data = t', {2: _swap_storage("step"), 3: _swap_storage("step")}, optimizers=ADAM),
]


def child_main() -> None:
    """In a child process (``python -m tests.optimizer_edits``): every storage swap under the lean step and the step
    inside backward against the chunked path; one line per run on stdout, ``name|optimizer|mode|outcome``."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import sys

    for edit in STORAGE_SWAPS:
        if len(sys.argv) > 1 and edit.name not in sys.argv[1:]:  # some by name (the default: all)
            continue
        for optimizer in edit.optimizers:
            if optimizer == "adamw8bit" and not eight_bit_runs():
                continue
            reference = fit(REFERENCE["adamw8bit"] if optimizer == "adamw8bit" else "chunked", optimizer, edit)
            for mode in ("lean", "in backward"):
                result = fit(mode, optimizer, edit)
                said = f" [{type(result['error']).__name__}: {result['error']}]" if "error" in result else ""
                line = f"{edit.name}|{optimizer}|{mode}|{outcome(result, reference)}{said}".replace("\n", " ")
                print(line, flush=True)


if __name__ == "__main__":
    child_main()
