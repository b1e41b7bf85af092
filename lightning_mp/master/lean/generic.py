"""Any ``torch.optim.Optimizer`` on lean master weights: its own ``step()`` on fp32 slices, chunk by chunk.

The optimizer keeps its own per-parameter state (torchao's 8-bit or 4-bit states, torch-optimi's Kahan buffers,
anything), keyed by *proxy* parameters: one fp32 ``nn.Parameter`` per slice of a model parameter. A slice is a
block of whole rows (along dim 0) of at most ``chunk_size`` elements, a multiple of 256 elements where the rows
allow it (block-quantised states: see ``QUANTUM``); a parameter that fits in a chunk is one slice with its own
shape. Between steps a proxy holds no storage (a zero-stride fp32 placeholder of its shape), so the
state is as small as the optimizer makes it and no fp32 copy of the model exists.

A step, per chunk of slices of one param group: join the slices' bf16 weights and remainders into an fp32 staging
buffer and point the proxies at it (``proxy.data``), give them fp32 gradients (upcast, clipping applied), put only
these proxies in their group's ``params`` (the other groups empty) and call the optimizer's ``step()``; then split
the staging values back into weights and remainders. The group's options (``lr``, and any counter the optimizer
keeps in the group) are put back as they were before each chunk but the first, so a per-group counter advances
once per step. Parameters kept in fp32 are sliced the same way, their proxies pointing at the parameter itself.
:meth:`GenericChunkedStep.run_params` runs one part of a step (the step inside backward: one parameter per call),
with the same rule across calls: the options are put back before every call but the first of the step.

Exactness: for an optimizer that treats elements independently (Adam family, SGD, Lion, torch-optimi, torchao's
block-quantised states, whose blocks the 256-aligned slices keep where they are in the whole parameter), the result
is the optimizer's own update of fp32 parameters holding the exact values. Optimizers that look at a parameter's
shape (Adafactor, Shampoo, Muon) see row blocks of parameters larger than ``chunk_size``; raise ``chunk_size`` above
the largest parameter to give them whole parameters (the transient memory then grows to that parameter's size).

Transient memory: fp32 staging values and gradients of one chunk (8 bytes x ``chunk_size``) plus the optimizer's
own temporaries for that chunk.

``found_inf`` (a step the plugin lets the device skip): the step is skipped on the device where it can be, by a
masked write-back per chunk. Before the chunk's ``optimizer.step()`` its optimizer state tensors (the inner tensors
of tensor subclasses such as torchao's 8-bit states) and the values of its fp32 parameters are copied; after it,
each becomes ``torch.where(found_inf, old, new)``, and the weights and remainders are written back the same way, so
a skipped step leaves every bit as it was and a finite one is the optimizer's own result, bit for bit. Group
options that are tensors (torch-optimi's per-group step counter, torchao's ``lr``) are masked once after the last
chunk. Extra transient memory: a copy of one chunk's optimizer state, and 4 bytes x ``chunk_size``. The flag is
read on the host instead (one synchronisation per step, the whole step skipped when it is nonzero) where masking
cannot keep the step exact:

- until the first step with a flag that finds the state made (the skip could not undo its creation, and the
  first step may set the optimizer up): that step also checks the next condition; and on any step where a
  parameter has no state yet;
- when the per-parameter state holds anything but tensors (a step counter as a Python number), when a step changes
  a group option that is not a tensor (a Python counter in ``param_groups``), or when a state tensor or a tensor
  option lives on another device than the flag: torch's for-loop optimizers, torchao and torch-optimi keep their
  step counters as CPU tensors, so on a GPU they are decided on the host (on a CPU run, or with ``capturable=True``
  optimizers on a GPU, they skip on the device);
- from the step on which the optimizer adds state it did not have (a buffer made late): that step reads the flag
  (and, when it must be skipped, removes what it added and puts the rest back), and later ones are decided on the
  host.

The masked skip and the group options are plain functions on tensors at the top of this module (:func:`leaves_of`,
:func:`mask`, :func:`mask_options`, :func:`snapshot`, :func:`put_back`) and :class:`StepOptions`, which keeps the
options of one optimizer step across its chunks and calls.

``optimizer.state_dict()`` and ``load_state_dict()`` see the proxies (hooks swap them into ``param_groups`` for the
call), so a checkpoint holds the per-slice state and resumes exactly into the same model and ``chunk_size``.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, Union, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_mp.master.lean.chunked import apply_grad_ops, apply_grad_ops_in_place, local_of
from lightning_mp.master.lean.interface import LeanStore


# ---------------------------------------------------------------------- the masked skip and the group options
def leaves_of(value: Tensor) -> list[Tensor]:
    """A plain tensor, or the plain inner tensors of a wrapper subclass (``__tensor_flatten__``), recursively."""
    flatten = getattr(value, "__tensor_flatten__", None)
    if type(value) is Tensor or flatten is None:
        return [value]
    return [leaf for name in flatten()[0] for leaf in leaves_of(getattr(value, name))]


def mask(skip: Tensor, before: dict[Any, list[Tensor]], after: dict[Any, list[Tensor]]) -> bool:
    """``after = where(skip, before, after)``, in place (no host synchronisation); ``False`` (nothing masked) when
    the step added or reshaped state."""
    if before.keys() != after.keys() or any(
        [t.shape for t in before[place]] != [t.shape for t in after[place]] for place in before
    ):
        return False
    for place, old_leaves in before.items():
        for old, new in zip(old_leaves, after[place]):
            torch.where(skip, old, new, out=new)
    return True


def mask_options(skip: Tensor, group: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
            torch.where(skip, value, current, out=current)


def same_option(current: Any, saved: Any) -> bool:
    try:
        return bool(current == saved)
    except (RuntimeError, TypeError, ValueError):  # containers of tensors and the like: not comparable here
        return False


def snapshot(group: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.clone() if isinstance(v, Tensor) else copy.copy(v)) for k, v in group.items() if k != "params"}


def put_back(group: dict[str, Any], saved: dict[str, Any]) -> None:
    for key, value in saved.items():
        current = group.get(key)
        if isinstance(value, Tensor) and isinstance(current, Tensor) and current.shape == value.shape:
            current.copy_(value)
        else:
            group[key] = copy.copy(value)


class StepOptions:
    """The param groups' options of one optimizer step that runs in several parts (chunks, and calls: the step inside
    backward steps one parameter per call). Saved at the step's first part and put back before every later one, so a
    per-group counter (or a tensor ``lr``) advances once per step; where parts are skipped on the device, the options
    are masked back to the saved ones while no part of the step has stepped."""

    def __init__(self) -> None:
        self.saved: Optional[list[dict[str, Any]]] = None  # the options before the step's first part
        self._none_stepped: Union[bool, Tensor] = True  # no part stepped: True, False, or a device flag

    def begin(self) -> None:
        """A new optimizer step: the next part's options are its start."""
        self.saved = None

    def start_part(self, groups: list[dict[str, Any]]) -> bool:
        """Before a part: whether it is the step's first (then its options are saved, else nothing happens)."""
        if self.saved is not None:
            return False
        self.saved, self._none_stepped = [snapshot(group) for group in groups], True
        return True

    def put_back(self, groups: list[dict[str, Any]]) -> None:
        """The options as they were before the step's first part (before every chunk or call but the first)."""
        assert self.saved is not None
        for group, saved in zip(groups, self.saved):
            put_back(group, saved)

    def part_done(self, groups: list[dict[str, Any]], skip: Optional[Tensor]) -> bool:
        """After a part; ``skip``: its device flag (``None``: it stepped, or was decided on the host). The options stay
        as stepped unless no part of the step stepped: then they are masked back on the device. ``True`` when masked."""
        none = self._none_stepped
        self._none_stepped = False if skip is None or none is False else skip if none is True else none & skip
        if not isinstance(self._none_stepped, Tensor):
            return False
        assert self.saved is not None
        for group, saved in zip(groups, self.saved):
            mask_options(self._none_stepped, group, saved)
        return True


# ---------------------------------------------------------------------- the slices and the step


class Slice:
    """Rows ``[row_start, row_end)`` of ``param`` (elements ``[start, end)`` of its flattening) and its proxy."""

    def __init__(self, param: Tensor, start: int, end: int, shape: tuple[int, ...]) -> None:
        self.param, self.start, self.end, self.shape = param, start, end, shape
        self.proxy = nn.Parameter(placeholder(shape, param.device), requires_grad=param.requires_grad)

    @property
    def numel(self) -> int:
        return self.end - self.start

    def point(self, values: Tensor, grad: Tensor) -> None:
        """Make the proxy (same object) hold ``values`` and ``grad``, tensors of the slice's shape."""
        self.proxy.data, self.proxy.grad = values, grad

    def rest(self) -> None:
        self.proxy.data = placeholder(self.shape, self.param.device)
        self.proxy.grad = None


def placeholder(shape: tuple[int, ...], device: torch.device) -> Tensor:
    return torch.zeros((), dtype=torch.float32, device=device).expand(shape)


#: Slices hold a multiple of this many elements where a chunk allows it (row blocks of ``QUANTUM / gcd(row,
#: QUANTUM)`` rows): block-quantised optimizer states (torchao's 8-bit: blocks of 256, 4-bit: 128) quantise a tensor
#: whose size is a multiple of their block and fall back to fp32 state otherwise; aligned slices also keep the blocks
#: where they are in the whole parameter, so the quantisation is the same.
QUANTUM = 256


def _slices_of(param: Tensor, chunk_size: int) -> list[Slice]:
    numel = param.numel()
    if numel <= chunk_size or param.dim() < 1:
        return [Slice(param, 0, numel, tuple(param.shape))]
    row = numel // param.shape[0]
    rows_per_slice = max(1, chunk_size // row)
    aligned = QUANTUM // math.gcd(row, QUANTUM)  # rows per multiple of QUANTUM elements
    if aligned <= rows_per_slice:
        rows_per_slice -= rows_per_slice % aligned
    slices = []
    for first in range(0, param.shape[0], rows_per_slice):
        last = min(first + rows_per_slice, param.shape[0])
        slices.append(Slice(param, first * row, last * row, (last - first, *param.shape[1:])))
    return slices


class GenericChunkedStep:
    """Runs ``optimizer.step()`` on fp32 proxy slices of the lean parameters, one chunk at a time (see module doc).

    Args:
        optimizer: the user's optimizer; its ``param_groups`` keep the model's parameters between steps.
        store: the :class:`~lightning_mp.master.lean.store.RemainderMasters` holding the weights and remainders.
        chunk_size: at most this many elements are fp32 at once (a bigger single row is one slice on its own).
    """

    #: the state is keyed by the proxies (:class:`~.eightbit.Adam8bitStep`'s by the parameters)
    whole_param_state = False
    #: inside backward the gradient is checked before :meth:`run_params` (the 8-bit step checks it in its call)
    checks_gradients = False

    def __init__(self, optimizer: Optimizer, store: LeanStore, chunk_size: int) -> None:
        self.optimizer = optimizer
        self.store = store
        self.chunk_size = chunk_size
        self.slices: list[list[Slice]] = [
            [s for p in group["params"] for s in self._slices_for(p)] for group in optimizer.param_groups
        ]
        self._model_params: list[list[Tensor]] = [list(g["params"]) for g in optimizer.param_groups]
        self.masks_on_device: Optional[bool] = None  # learnt on the first step with a flag (see the module doc)
        self._plain: dict[tuple[int, str], Any] = {}
        self._by_param: dict[int, tuple[int, list[Slice]]] = {}  # id(parameter) -> (its group, its slices)
        for index, slices in enumerate(self.slices):
            for s in slices:
                self._by_param.setdefault(id(s.param), (index, []))[1].append(s)
        self._options = StepOptions()  # the group options across the chunks (and run_params calls) of a step
        self._hooks = [
            optimizer.register_state_dict_pre_hook(lambda opt: self._swap_in_proxies()),
            optimizer.register_state_dict_post_hook(lambda opt, state: self._swap_out_proxies()),
            optimizer.register_load_state_dict_pre_hook(lambda opt, state: self._swap_in_proxies()),
            optimizer.register_load_state_dict_post_hook(lambda opt: self._swap_out_proxies()),
        ]

    def follow_groups(self) -> None:
        """Slice the groups appended since (``add_param_group``); a group changed in place raises."""
        groups = self.optimizer.param_groups
        known = [[id(p) for p in params] for params in self._model_params]
        if len(groups) < len(known) or any([id(p) for p in g["params"]] != ids for g, ids in zip(groups, known)):
            raise ValueError(
                f"{type(self.optimizer).__name__}'s param groups changed in place after setup; master_weights='remainder' "
                "follows only groups appended by add_param_group with this optimizer. Add parameters with it."
            )
        for index, group in enumerate(groups[len(known) :], start=len(known)):
            self.slices.append([s for p in group["params"] for s in self._slices_for(p)])
            self._model_params.append(list(group["params"]))
            for s in self.slices[-1]:
                self._by_param.setdefault(id(s.param), (index, []))[1].append(s)

    def _slices_for(self, param: Tensor) -> list[Slice]:
        return _slices_of(param, self.chunk_size)

    def _swap_in_proxies(self) -> None:
        for group, slices in zip(self.optimizer.param_groups, self.slices):
            group["params"] = [s.proxy for s in slices]

    def _swap_out_proxies(self) -> None:
        for group, params in zip(self.optimizer.param_groups, self._model_params):
            group["params"] = list(params)

    def run(self, found_inf: Optional[Tensor], grad_ops: list[tuple[str, Any]]) -> None:
        """One step of the optimizer over every chunk; where ``found_inf`` is nonzero, none: skipped on the device
        by a masked write-back, or decided on the host where masking cannot be exact (see the module doc)."""
        chunks = [(index, chunk) for index, slices in enumerate(self.slices) for chunk in self._chunks(slices)]
        fp32 = [p for params in self._model_params for p in params if self.store.offset_of(p) is None]
        self._options.begin()  # a whole step: the options are saved at its start
        self._run(chunks, fp32, found_inf, grad_ops, on_host=False)

    def begin_params(self) -> None:
        """Before the first :meth:`run_params` of an optimizer step (the step inside backward: at ``begin``)."""
        self._options.begin()

    def end_params(self) -> None:
        """After the last :meth:`run_params` of a step inside backward: nothing is owed here (each call settled
        its own skip)."""

    def run_params(
        self, params: list[Tensor], found_inf: Optional[Tensor], grad_ops: list[Any], on_host: Any = None
    ) -> None:
        """The optimizer's step on ``params``' slices only: one part of an optimizer step whose other parts are other
        calls since :meth:`begin_params` (the step inside backward: one call per parameter, from its hook).

        The group options are put back before every call but the first of the step, as the chunk loop puts them back
        before every chunk but the first, so a per-group counter advances once per step; they stay advanced when any
        call of the step stepped (a masked skip masks them with "no call stepped so far"). ``found_inf`` nonzero
        skips these parameters only: read on the host where ``on_host`` (default ``None``: on a CPU, where reading it
        is free), else masked where :attr:`masks_on_device`, else read on the host (one synchronisation per call)."""
        chunks = []
        for param in params:
            index, slices = self._by_param[id(param)]
            chunks += [(index, chunk) for chunk in self._chunks(slices)]
        fp32 = [p for p in params if self.store.offset_of(p) is None]
        if on_host is None:
            on_host = found_inf is not None and found_inf.device.type == "cpu"
        self._run(chunks, fp32, found_inf, grad_ops, on_host)

    def _run(
        self, chunks: list[Any], fp32: list[Tensor], found_inf: Optional[Tensor], grad_ops: list[Any], on_host: bool
    ) -> None:
        skip: Optional[Tensor] = None
        had_state = False
        if found_inf is not None:
            had_state = all(self.optimizer.state.get(s.proxy) for _, chunk in chunks for s in chunk)
            if self.masks_on_device and had_state and not on_host:
                skip = found_inf.reshape(()) > 0  # stays on the device
            elif bool(found_inf.item()):  # a host synchronisation
                return
        groups = self.optimizer.param_groups
        apply_grad_ops_in_place(fp32, grad_ops)
        first = self._options.start_part(groups)
        try:
            for number, (index, chunk) in enumerate(chunks):
                if number or not first:
                    self._options.put_back(groups)
                staged = self._stage(chunk)
                if staged is not None:
                    apply_grad_ops(staged, grad_ops)
                for position, group in enumerate(groups):
                    group["params"] = [s.proxy for s in chunk] if position == index else []
                before = self._save(chunk) if skip is not None else None
                self.optimizer.step()
                if (
                    before is not None
                    and skip is not None
                    and (self._plain_changed(chunk) or not mask(skip, before, self._tensors(chunk)))
                ):
                    if self._state_changed(chunk, before, skip):  # read on the host: skipped after all
                        self._unstage(chunk, skip)  # the weights as they were
                        break  # the chunks not stepped yet stay as they are
                    skip = None  # read on the host: the step stands, the other chunks step unmasked
                self._unstage(chunk, skip)
            masked = self._options.part_done(groups, skip)  # as stepped unless no part of the step stepped
            saved = self._options.saved
            if not masked and found_inf is not None and self.masks_on_device is None and had_state and saved:
                self.masks_on_device = self._maskable(found_inf.device, saved)
        finally:
            for _, chunk in chunks:
                for s in chunk:
                    s.rest()
            self._swap_out_proxies()

    def _chunks(self, slices: list[Slice]) -> list[list[Slice]]:
        chunks: list[list[Slice]] = []
        current: list[Slice] = []
        filled = 0
        for s in slices:
            if s.param.grad is None:
                continue
            joined = self.store.offset_of(s.param) is not None
            if current and (
                filled + s.numel > self.chunk_size
                or current[0].param.device != s.param.device
                or (self.store.offset_of(current[0].param) is not None) != joined
            ):
                chunks.append(current)
                current, filled = [], 0
            current.append(s)
            filled += s.numel
        if current:
            chunks.append(current)
        return chunks

    def _stage(self, chunk: list[Slice]) -> Optional[Tensor]:
        """Point the chunk's proxies at fp32 values and gradients; the staged fp32 gradients (for clipping)."""
        first = chunk[0].param
        if self.store.offset_of(first) is None:  # fp32 parameters: the proxies are views of the parameters
            for s in chunk:
                value, grad = (
                    local_of(t).detach().view(-1)[s.start : s.end].view(s.shape)
                    for t in (s.param, cast(Tensor, s.param.grad))  # (a stepped slice: its gradient is there)
                )
                s.point(value, grad)
            return None
        device = local_of(first).device
        values, grads = self.store.updates.staging.buffers(device)
        total = sum(s.numel for s in chunk)
        if total > values.numel():  # a chunk of one slice longer than chunk_size (one row, or a whole local shard)
            values, grads = torch.empty(total, device=device), torch.empty(total, device=device)
        position = 0
        for s in chunk:
            view = slice(position, position + s.numel)
            offset = self.store.offset_of(s.param)
            assert offset is not None  # a lean parameter (fp32 ones are taken above)
            high, low = self.store.flat_slices(device, offset + s.start, offset + s.end)
            self.store.codec.join_into(high, low, values[view])
            grads[view].copy_(local_of(cast(Tensor, s.param.grad)).detach().reshape(-1)[s.start : s.end])
            s.point(values[view].view(s.shape), grads[view].view(s.shape))
            position += s.numel
        return grads[:position]

    def _unstage(self, chunk: list[Slice], skip: Optional[Tensor] = None) -> None:
        for s in chunk:
            offset = self.store.offset_of(s.param)
            if offset is None:
                continue
            high, low = self.store.flat_slices(s.param.device, offset + s.start, offset + s.end)
            if skip is None:
                self.store.codec.split_into(self._values_of(s).reshape(-1), high, low)
                continue
            new_high, new_low = torch.empty_like(high), torch.empty_like(low)  # a slice's worth: within the chunk
            self.store.codec.split_into(self._values_of(s).reshape(-1), new_high, new_low)
            torch.where(skip, high, new_high, out=high)
            torch.where(skip, low, new_low, out=low)

    def _values_of(self, s: Slice) -> Tensor:
        """The values a slice's proxy points at (a plain tensor)."""
        return s.proxy.data

    def _tensors(self, chunk: list[Slice]) -> dict[tuple[int, str], list[Tensor]]:
        """The tensors a step of ``chunk`` may change, by (slice, key): the values of its fp32 parameters (key
        ``""``; the lean ones are masked at the write-back) and every state tensor of its proxies (subclasses: their
        inner tensors)."""
        tensors: dict[tuple[int, str], list[Tensor]] = {}
        for index, s in enumerate(chunk):
            if self.store.offset_of(s.param) is None:
                tensors[(index, "")] = [self._values_of(s)]
            for key, value in self.optimizer.state[s.proxy].items():
                tensors[(index, key)] = leaves_of(value) if isinstance(value, Tensor) else []  # None: unused buffer
        return tensors

    def _save(self, chunk: list[Slice]) -> dict[tuple[int, str], list[Tensor]]:
        self._plain = {  # what is not a tensor (None, ...), to put back if a skipped step changes it
            (index, key): copy.copy(value)
            for index, s in enumerate(chunk)
            for key, value in self.optimizer.state[s.proxy].items()
            if not isinstance(value, Tensor)
        }
        return {place: [t.clone() for t in leaves] for place, leaves in self._tensors(chunk).items()}

    def _plain_changed(self, chunk: list[Slice]) -> bool:
        plain = {
            (index, key): value
            for index, s in enumerate(chunk)
            for key, value in self.optimizer.state[s.proxy].items()
            if not isinstance(value, Tensor)
        }
        return plain.keys() != self._plain.keys() or not all(same_option(plain[k], self._plain[k]) for k in plain)

    def _state_changed(self, chunk: list[Slice], before: dict[tuple[int, str], list[Tensor]], skip: Tensor) -> bool:
        """The step added (or reshaped) state: no mask can undo that. From now on this optimizer's skips are decided
        on the host; this one is read now (a host synchronisation) and, if skipped, the chunk's state is put back.
        Whether the step is skipped."""
        self.masks_on_device = False
        if not bool(skip.item()):
            return False  # the step stands (the chunks before were masked with a zero flag: unchanged)
        for index, s in enumerate(chunk):
            state = self.optimizer.state[s.proxy]
            for key in [k for k in state if (index, k) not in before]:
                del state[key]  # made by this step
            for (place, key), old in before.items():
                if place == index and key and (place, key) in self._plain:
                    state[key] = self._plain[(place, key)]  # not a tensor before this step (None: an unused buffer)
                elif place == index and key:
                    leaves = leaves_of(state[key])
                    if [t.shape for t in leaves] != [t.shape for t in old]:
                        raise RuntimeError(
                            f"{type(self.optimizer).__name__}.step() reshaped its state {key!r} on a step that had "
                            "to be skipped; master_weights='remainder' cannot put it back. Register a skip observer "
                            "(plugin.skip_observers.append(lambda **_: None)) so every skip is decided on the host."
                        )
                    for leaf, saved in zip(leaves, old):
                        leaf.copy_(saved)
            if (index, "") in before:
                self._values_of(s).copy_(before[(index, "")][0])
        return True

    def _maskable(self, device: torch.device, options: list[dict[str, Any]]) -> bool:
        """After a host-decided step: whether later steps can be skipped on ``device`` by masking (module doc)."""
        for slices in self.slices:
            for s in slices:
                for value in self.optimizer.state.get(s.proxy, {}).values():
                    if value is None:  # an unused buffer (torch-optimi's Kahan buffer of an fp32 parameter)
                        continue
                    leaves = leaves_of(value) if isinstance(value, Tensor) else []
                    if not leaves or any(t.device != device for t in leaves):
                        return False
        for group, saved in zip(self.optimizer.param_groups, options):
            for key, value in saved.items():
                current = group.get(key)
                if isinstance(value, Tensor):
                    if not isinstance(current, Tensor) or current.device != device:
                        return False
                elif not same_option(current, value):
                    return False
        return True

    def restore(self) -> None:
        """At teardown: state of a parameter held by one whole-parameter proxy moves to the parameter; per-slice
        state of parameters split across chunks cannot become one parameter's state and is dropped."""
        for slices in self.slices:
            for s in slices:
                state = self.optimizer.state.pop(s.proxy, None)
                if state is not None and s.numel == s.param.numel():
                    self.optimizer.state[s.param] = state
        for hook in self._hooks:
            hook.remove()
