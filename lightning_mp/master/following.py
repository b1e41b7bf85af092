"""Following the user: what torch's optimizer reads now, against what a cache was built from. The one place that
compares.

The step keeps caches of what ``optimizer.step()`` would read: the step plans and their fast calls inside backward
(:mod:`~lightning_mp.master.lean.plan`), the update's path (:mod:`~lightning_mp.master.lean.update`), the chunked
path's pieces, the gradients grouped for the unscale (:mod:`lightning_mp.stepping`), the groups the stores hold
masters for (:mod:`~lightning_mp.master.flat`, :mod:`~lightning_mp.master.lean.store`), the hooks of the step inside
backward. Each is a claim, and the user's code changes what it claims between any two steps, by many routes that
keep the containers' identity and size: ``add_param_group``, ``group["params"]`` edited in place (``append``,
``del``, item assignment, a permutation) or replaced, a group's ``amsgrad`` switched, ``load_state_dict`` (a new
``state``), a parameter's state reset (``= {}``, ``.clear()``) or restored from a copy, a state tensor assigned or
given new storage (``exp_avg.data = t``), ``p.data = t``. torch's optimizer reads whatever is there at ``step()``.

So every cache asks one question, :func:`seen`, and compares the answer with the one it was built at: a
:class:`Generation`, two counters of the optimizer that change whenever what they cover changed since anyone asked.

- ``groups``: the ``param_groups`` list, each group dict, each group's parameters element by element, and the truth
  of the options that change which state exists or which path steps the group (:data:`LAYOUT_OPTIONS`:
  ``amsgrad``, SGD's ``momentum`` on or off, ``capturable``, ``differentiable``; their values are an LR scheduler's
  business: OneCycleLR cycles ``momentum`` every step and changes nothing here).
- ``state`` (asked with ``state=True``): ``groups``, and the ``state`` object, each parameter's state dict, every
  value in them, the address of every state tensor and of every parameter (a tensor's ``.data = t`` swaps the memory
  a kernel was given).

A cache built at one generation is used only while :func:`seen` returns it; otherwise it is made again, never
patched. Comparisons are identities and addresses in C-level passes (``map(operator.is_, ...)``), no Python loop per
parameter, no aten op. The objects compared are held, not their ids (a freed object's id, taken by a new one, cannot
pass for it), and so are the storages of the state tensors whose addresses are compared (a freed address cannot come
back under a new tensor). The record is kept per optimizer, for as long as the optimizer lives.

Changes the plugin makes itself (the state a first step makes, masters swapped into the groups) are changes too:
the caches built before them are made once more at the next step, then stay.
"""

from __future__ import annotations

import weakref
from itertools import chain, repeat
from operator import attrgetter, is_, truth
from typing import Any, NamedTuple, Optional

from torch import Tensor
from torch.optim import Optimizer

#: Group options whose truth changes which state torch's optimizers keep, or which path the lean update takes:
#: Adam's ``amsgrad`` (a third state tensor), SGD's ``momentum`` (a momentum buffer or none), ``capturable`` and
#: ``differentiable`` (the table's entry or the generic path: :func:`~lightning_mp.master.lean.optimizers.entry_for`).
LAYOUT_OPTIONS = ("amsgrad", "momentum", "capturable", "differentiable")

_EMPTY: dict[str, Any] = {}


class Generation(NamedTuple):
    """What :func:`seen` answers: ``groups`` changes with the groups, ``state`` with the groups or the state."""

    groups: int
    state: int


class _Record:
    """One optimizer's groups and state as last seen (module doc)."""

    __slots__ = (
        "groups_list", "groups", "params", "truths", "flat", "generation_groups", "generation_state", "state",
        "dicts", "values", "tensors", "addresses", "param_addresses", "storages", "sharded", "state_valid", "wrapped",
    )  # fmt: skip

    def __init__(self) -> None:
        self.groups_list: Any = None
        self.groups: list[dict[str, Any]] = []
        self.params: list[list[Tensor]] = []
        self.truths: list[tuple[bool, ...]] = []
        self.flat: list[Tensor] = []
        self.generation_groups = 0
        self.generation_state = 0
        self.state_valid = False  # the fields below hold what was last recorded (_record_state)
        self.state: Any = None
        self.dicts: list[Any] = []
        self.values: list[Any] = []
        self.tensors: list[Tensor] = []
        self.addresses: list[int] = []
        self.param_addresses: list[int] = []
        self.storages: list[Any] = []
        self.sharded = False
        #: state values that are wrapper subclasses (torchao's 8-bit states): (getter of their inner tensors' names,
        #: the values, the inner tensors recorded), one entry per (class, names)
        self.wrapped: list[tuple[Any, list[Tensor], list[Tensor]]] = []


_RECORDS: weakref.WeakKeyDictionary[Optimizer, _Record] = weakref.WeakKeyDictionary()


def seen(optimizer: Optimizer, state: bool = False) -> Generation:
    """``optimizer``'s :class:`Generation` now: compared with what was seen at the last call (any caller's), and
    advanced where anything changed since (module doc). With ``state=False`` the ``state`` counter is not brought up
    to date (it advances at the next call that asks for it)."""
    record = _RECORDS.get(optimizer)
    if record is None:
        record = _RECORDS[optimizer] = _Record()
    groups = optimizer.param_groups
    changed = (
        groups is not record.groups_list
        or len(groups) != len(record.groups)
        or not all(map(is_, groups, record.groups))
    )
    if not changed:
        for group, params, truths in zip(groups, record.params, record.truths):
            current = group["params"]
            if (
                len(current) != len(params)
                or not all(map(is_, current, params))
                or tuple(map(truth, map(group.get, LAYOUT_OPTIONS))) != truths
            ):
                changed = True
                break
    if changed:
        record.groups_list, record.groups = groups, list(groups)
        record.params = [list(group["params"]) for group in groups]
        record.truths = [tuple(map(truth, map(group.get, LAYOUT_OPTIONS))) for group in groups]
        record.flat = list(chain.from_iterable(record.params))
        record.generation_groups += 1
        record.generation_state += 1
        record.state_valid = False
    if state:
        # the state as recorded: the state object, each parameter's dict, every value, the addresses (module doc)
        unchanged = record.state_valid and optimizer.state is record.state
        if unchanged:
            dicts = list(map(optimizer.state.get, record.flat, repeat(_EMPTY)))
            unchanged = all(map(is_, dicts, record.dicts))
        if unchanged:
            values = list(chain.from_iterable(map(dict.values, dicts)))
            sharded = record.sharded
            unchanged = (
                len(values) == len(record.values)
                and all(map(is_, values, record.values))
                and (not record.wrapped or _same_inner(record.wrapped))
                and list(map(Tensor.data_ptr, record.tensors)) == record.addresses
                and list(map(Tensor.data_ptr, map(_local, record.flat) if sharded else record.flat))
                == record.param_addresses
            )
        if not unchanged:
            _record_state(record, optimizer)
            if not changed:
                record.generation_state += 1
    return Generation(record.generation_groups, record.generation_state)


def _record_state(record: _Record, optimizer: Optimizer) -> None:
    record.state = optimizer.state
    record.dicts = list(map(optimizer.state.get, record.flat, repeat(_EMPTY)))
    record.values = list(chain.from_iterable(map(dict.values, record.dicts)))
    values = [v for v in record.values if isinstance(v, Tensor)]
    record.sharded = any(_local(t) is not t for t in chain(values, record.flat))
    # a plain state tensor, or a wrapper subclass's inner tensors (a DTensor's local shard; torchao's codes, scale and
    # map), which hold the memory, level by level (a DTensor of an 8-bit state: its local shard, then that one's
    # tensors): their identities are compared by name through the values, their addresses as the others'
    plain: list[Tensor] = []
    record.wrapped = []
    pending = values
    while pending:
        wrapped: dict[tuple[type, tuple[str, ...]], list[Tensor]] = {}
        for value in pending:
            if type(value) is Tensor or not hasattr(value, "__tensor_flatten__"):
                plain.append(value)
            else:  # a DTensor's local shard by name (its flattening names more), any other's inner tensors
                names = ("_local_tensor",) if hasattr(value, "_local_tensor") else _inner_names(value)
                wrapped.setdefault((type(value), names), []).append(value)
        pending = []
        for (_, names), held in wrapped.items():
            getter = _getter(names)
            inner = list(chain.from_iterable(map(getter, held)))
            record.wrapped.append((getter, held, inner))
            pending += inner
    record.tensors = plain
    record.addresses = list(map(Tensor.data_ptr, record.tensors))
    record.param_addresses = list(map(Tensor.data_ptr, _locals(record.flat, record.sharded)))
    record.storages = [t.untyped_storage() for t in record.tensors]  # held (module doc)
    record.state_valid = True


def _same_inner(wrapped: list[tuple[Any, list[Tensor], list[Tensor]]]) -> bool:
    """Whether every recorded wrapper subclass still holds the inner tensors recorded (by identity, by name)."""
    return all(all(map(is_, chain.from_iterable(map(getter, values)), inner)) for getter, values, inner in wrapped)


def _inner_names(value: Tensor) -> tuple[str, ...]:
    """The names of a wrapper subclass's inner tensors (``__tensor_flatten__``'s, those that are tensors)."""
    names = value.__tensor_flatten__()[0]  # type: ignore[attr-defined]
    return tuple(name for name in names if isinstance(getattr(value, name), Tensor))


def _getter(names: tuple[str, ...]) -> Any:
    """A function from a wrapper subclass to the tuple of its inner tensors named ``names``."""
    return attrgetter(*names) if len(names) > 1 else (lambda value, get=attrgetter(names[0]): (get(value),))


def _local(tensor: Tensor) -> Tensor:
    # a DTensor's local shard (the same storage): the addresses a kernel is given are the shard's
    return getattr(tensor, "_local_tensor", tensor)


def _locals(tensors: list[Tensor], sharded: bool) -> Any:
    return map(_local, tensors) if sharded else tensors


def group_index(optimizer: Optimizer, param: Tensor) -> Optional[int]:
    """The index of the first group of ``optimizer`` that holds ``param`` (by identity), for messages; ``None``."""
    for index, group in enumerate(optimizer.param_groups):
        if any(map(is_, group["params"], repeat(param))):
            return index
    return None


def forget(optimizer: Optimizer) -> None:
    """Drop ``optimizer``'s record (its held storages): the next :func:`seen` starts a new one."""
    _RECORDS.pop(optimizer, None)
