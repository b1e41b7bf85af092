"""The one owner of the agreement between a model's parameters and its master weights: every write reaches the masters.

The plugin's own step is one writer of a model among several: a ``load_state_dict`` into the model or any submodule
(Lightning's resume, ``fabric.load``, LitGPT's ``load_checkpoint``), an ``nn.init`` in a hook, a callback that
replaces a layer's weight. :class:`ModelSync` sees each of them and makes the masters follow, or fails loudly:

- **loads**: hooks on every module that owns a converted parameter (a load pre-hook on the root alone does not see
  ``model.child.load_state_dict(...)``: torch calls each submodule's ``_load_from_state_dict`` with its own prefix)
  keep each loaded value, whatever torch can copy from (tensors, mmap'd tensors, safetensors, DTensors, tensor-likes
  with ``__torch_function__`` such as LitGPT's ``NotYetLoadedTensor``), and once torch has copied it into the model
  the store makes it the exact fp32 master (:meth:`~lightning_mp.master.MasterWeights.load_fp32`).
- **saves**: a state-dict hook on the same modules writes the exact fp32 values in place of the 16-bit ones.
- **other writes**, found by :meth:`ModelSync.follow` once per step (before the update) and before every save and
  teardown: an in-place write bumps the parameter's version counter (``nn.init.*``, ``copy_``/``fill_``/``mul_``
  under ``no_grad``, ``reset_parameters()``), ``p.data = t`` changes its storage (``data_ptr()``), and
  ``module.weight = nn.Parameter(t)`` puts another object in the module. The masters become the value now in the
  model (:meth:`~lightning_mp.master.MasterWeights.follow_write`): the 16-bit value with a zero remainder, or the
  fp32 value a replacement carries; a replaced parameter object is put back into the module holding the new value
  (the optimizer keeps stepping the object it holds). A write that cannot be followed (another shape, device or a
  non-floating dtype, a removed parameter) raises :class:`ModelWriteError` naming the parameter.

The check is three C-level passes over lists (version counters, storage addresses, the objects the modules hold),
compared with the lists recorded after the last write the masters know of: no Python per parameter while nothing
was written. ``p.data.copy_(t)`` bumps no counter and keeps the storage: nothing in torch records it, and it is the
one write the masters cannot follow (write ``with torch.no_grad(): p.copy_(t)`` instead).

Each :class:`ModelSync` also says which parameters it holds, by their identity (:func:`holder_of`): every parameter
of the model it was made for, converted or kept in fp32, from its creation until :meth:`ModelSync.remove` (teardown).
Code handed any module (a submodule, a module reached by any path) finds the masters of its parameters from the
parameters themselves. The registry holds weak references on both sides: it keeps neither a parameter nor a store
alive.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, NoReturn, Optional, Protocol

import torch
from torch import Tensor, nn
from torch.overrides import is_tensor_like
from torch.utils.weak import WeakIdKeyDictionary

from lightning_mp.master.buffers import ConvertedBuffers
from lightning_mp.master.refused_callbacks import PRUNING

_version = operator.attrgetter("_version")

#: How to write a parameter so the masters follow (quoted by every error and the docs).
HOW_TO_WRITE = (
    "Write it in place with the same shape, e.g. `with torch.no_grad(): param.copy_(value)`, nn.init.*, or "
    "module.load_state_dict(...) (any of them followed exactly)."
)


class MasterStore(Protocol):
    """What the model sync (and :mod:`~lightning_mp.master.exact`) reads of a master-weights store: the flat fp32
    masters (:class:`~lightning_mp.master.MasterWeights`) and the lean ones
    (:class:`~lightning_mp.master.RemainderMasters`), both on :class:`~lightning_mp.master.converted.ConvertedModel`."""

    #: whether a write in place can be followed element by element (fp32 masters: yes; lean ones: no)
    tells_changed_values: bool

    def fp32_value(self, param: Tensor) -> Tensor:
        """The exact fp32 value of a converted parameter (a fresh tensor, or the master itself)."""
        ...

    def load_fp32(self, param: nn.Parameter, value: Any) -> None:
        """A load brought ``value`` for ``param``: the masters take it exactly."""
        ...

    def follow_write(self, param: nn.Parameter, value: Optional[Tensor]) -> int:
        """``param`` was written outside the step (``value`` ``None``: in place); how many values were taken at
        16-bit precision."""
        ...

    def master_of(self, param: Tensor) -> Optional[nn.Parameter]:
        """The fp32 master tensor of a model parameter, or ``None`` (lean masters hold none)."""
        ...


class ModelWriteWarning(UserWarning):
    """Code outside the plugin wrote 16-bit values into parameters that have fp32 masters (said once per fit)."""


def rounded_writes_message(rounded: list[tuple[str, int, int]], tells_changed_values: bool = True) -> str:
    """The warning for writes in place taken at 16-bit precision: ``(parameter name, values taken, values)``."""
    shown = ", ".join(f"{name!r}: {taken} of {total} values" for name, taken, total in rounded[:6])
    more = f" and {len(rounded) - 6} more" if len(rounded) > 6 else ""
    how = (
        "values the write left as they were kept their exact masters"
        if tells_changed_values
        else "lean masters cannot tell which values a write changed (the remainders complete the 16-bit weights the "
        "write overwrote), so each written parameter was taken whole"
    )
    return (
        f"MixedPrecisionPlugin with master weights: code outside the plugin wrote into {len(rounded)} parameter(s) in "
        f"place during fit ({shown}{more}). The model holds 16-bit weights, so the written values reached the fp32 "
        f"masters at 16-bit precision ({how}); an fp32 model would have kept them exact. Write inside exact_weights, "
        "where the parameters are the exact fp32 masters and what you write is kept exactly, e.g. (`from "
        "lightning_mp.master import exact_weights`)\n"
        "    with torch.no_grad(), exact_weights(model):\n"
        "        for p in model.parameters(): p.clamp_(-0.01, 0.01)\n"
        "(said once per fit; loads and `param.data = fp32 tensor` are followed exactly)."
    )


class ModelWriteError(RuntimeError):
    """A write into the model after setup that the master weights cannot follow; names the parameter.
    ``repeated``: the same error was raised before (teardown, which gives the model its exact weights, then does
    not raise it again)."""

    repeated = False


class ModelSync:
    """Hooks and per-step check that keep ``store``'s masters equal to ``module``'s parameters (see module doc).

    Args:
        store: the master-weights store (:class:`~lightning_mp.master.MasterWeights` or
            :class:`~lightning_mp.master.RemainderMasters`, both on :class:`~lightning_mp.master.converted.
            ConvertedModel`): it provides ``fp32_value(param)``, ``load_fp32(param, value)``,
            ``follow_write(param, value)``.
        module: the converted model.
        params: ``id(parameter) -> parameter`` for every parameter that has a master.
        buffers: the converted buffers (:class:`~lightning_mp.master.buffers.ConvertedBuffers`): saved at full
            precision with what training wrote into them; a load into them is their exact value.
        watch_objects: compare the objects the modules hold and the storage addresses too (``False`` under FSDP2,
            which swaps sharded and unsharded parameters in the modules itself).
    """

    def __init__(
        self,
        store: MasterStore,
        module: nn.Module,
        params: dict[int, nn.Parameter],
        buffers: Optional[ConvertedBuffers] = None,
        watch_objects: bool = True,
    ) -> None:
        self.store = store
        self.watch_objects = watch_objects
        self.started = False
        self._paused = False  # inside exact_weights: the modules hold fp32 stand-ins, not a write
        #: refuse ``p.data = t`` of another dtype (under DDP: torch then drops the gradient accumulator DDP hooks)
        self.keep_dtypes = False
        self._params: list[nn.Parameter] = list(params.values())
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._shapes = [tuple(p.shape) for p in self._params]
        self._names: dict[int, str] = {}
        # per owning module: [(attribute name, parameter)]
        self._owned: dict[int, list[tuple[str, nn.Parameter]]] = {}
        self._buffers = buffers if buffers is not None else ConvertedBuffers()
        owners: dict[int, nn.Module] = {}
        for module_name, owner in module.named_modules():
            for name, param in owner._parameters.items():
                if param is not None and id(param) in params:
                    self._owned.setdefault(id(owner), []).append((name, param))
                    owners[id(owner)] = owner
                    self._names.setdefault(id(param), f"{module_name}.{name}" if module_name else name)
        for owner in self._buffers.owners():
            owners[id(owner)] = owner
        # the slots the check compares: the dict each owner keeps its parameters in, the name, the object expected
        slots = [(owners[key]._parameters, name, param) for key, owned in self._owned.items() for name, param in owned]
        self._slot_dicts = [s[0] for s in slots]
        self._slot_names = [s[1] for s in slots]
        self._slot_params = [s[2] for s in slots]
        self._slot_ids = [id(s[2]) for s in slots]
        self._versions: list[int] = []
        self._pointers: list[int] = []
        #: changes whenever a parameter's recorded storage changes: what made aliases of the parameters' storage
        #: (the flat masters' write-back) compare to know they are still the parameters' (no per-parameter check)
        self.storage_generation = 0
        self._held: list[Tensor] = []  # the recorded storages, kept alive (see record_storage)
        self._devices = [p.device for p in self._params]  # where the masters expect each parameter, in which dtype
        self._dtypes = [p.dtype for p in self._params]
        self._loaded: dict[int, Any] = {}  # id(param) -> the value a load in progress brings
        self._raised: Optional[str] = None  # the last ModelWriteError's message
        self._warned = False  # a write in place was taken at 16-bit precision and said so (once per fit)
        self._hooks = [
            hook
            for owner in owners.values()
            for hook in (
                owner._register_state_dict_hook(self._state_dict_hook),
                owner.register_load_state_dict_pre_hook(self._load_pre_hook),
                owner.register_load_state_dict_post_hook(self._load_post_hook),
            )
        ]
        self._held_params = list(module.parameters())  # (tied ones once) what holder_of answers for, until remove()
        self_ref = weakref.ref(self)
        for param in self._held_params:
            _HOLDERS[param] = self_ref
        self.record()

    # ------------------------------------------------------------------ the record and the check
    def _pointer_list(self) -> list[int]:
        return list(map(Tensor.data_ptr, self._params)) if self.watch_objects else []

    def _slot_list(self) -> list[int]:
        return list(map(id, map(dict.get, self._slot_dicts, self._slot_names))) if self.watch_objects else []

    def record(self) -> None:
        """Take the parameters as they are now as known to the masters (after a write by the plugin itself)."""
        self._versions = list(map(_version, self._params))
        self.record_storage()

    def record_storage(self) -> None:
        """Take the parameters' storage as it is now as known (the plugin moved them itself); versions stay. Once
        started, the recorded storages are held: a storage freed by ``p.data = t`` could otherwise come back at the
        same address for a later ``p.data = t2``, which the address alone would not tell apart."""
        pointers = self._pointer_list()
        if pointers != self._pointers or not self.watch_objects:  # without addresses: any record may be new storage
            self.storage_generation += 1
        self._pointers = pointers
        self._held = [p.data for p in self._params] if self.started and self.watch_objects else []
        self._devices = [p.device for p in self._params]
        self._dtypes = [p.dtype for p in self._params]

    def start(self) -> None:
        """Setup is over: from now on every write is followed. Called again (a later connect), follow what changed."""
        if self.started:
            self.follow()
        self.started = True
        self.record()

    def unchanged(self) -> bool:
        """Whether nothing wrote the parameters since the last record (three list comparisons, no Python loop)."""
        return (
            list(map(_version, self._params)) == self._versions
            and self._pointer_list() == self._pointers
            and self._slot_list() == self._slot_ids
        )

    def follow(self) -> None:
        """Make the masters follow every write since the last record; raise :class:`ModelWriteError` for one that
        cannot be followed. Called before each update, before each save, at teardown."""
        if not self.started or self._paused:
            return
        versions = list(map(_version, self._params))  # the check of unchanged(), inlined: it runs every step
        pointers = list(map(Tensor.data_ptr, self._params)) if self.watch_objects else []
        if (
            versions == self._versions
            and pointers == self._pointers
            and (
                not self.watch_objects
                or list(map(id, map(dict.get, self._slot_dicts, self._slot_names))) == self._slot_ids
            )
        ):
            return
        replaced = self._put_back_replaced() if self.watch_objects else {}
        if replaced:
            pointers = self._pointer_list()
            versions = list(map(_version, self._params))
        rounded: list[tuple[str, int, int]] = []  # (name, values taken at 16-bit precision, values) per parameter
        with torch.no_grad():
            for index, param in enumerate(self._params):
                if id(param) in replaced:
                    self.store.follow_write(param, replaced[id(param)])
                elif self.watch_objects and pointers[index] != self._pointers[index]:
                    self._check_value(param, param.data, "given new storage (`param.data = tensor`)", self.keep_dtypes)
                    self.store.follow_write(param, param.data)
                elif versions[index] != self._versions[index]:
                    taken = self.store.follow_write(param, None)
                    if taken:
                        rounded.append((self.name_of(param), taken, param.numel()))
        self.record()
        if rounded and not self._warned:
            self._warned = True
            warnings.warn(rounded_writes_message(rounded, self.store.tells_changed_values), ModelWriteWarning, 3)

    def _put_back_replaced(self) -> dict[int, Tensor]:
        """Put back the parameter objects the masters belong to where a module holds another one now; their new
        values, by ``id`` of the object put back."""
        values: dict[int, Tensor] = {}
        current = list(map(dict.get, self._slot_dicts, self._slot_names))  # None: deleted or set to None
        for slots, name, param, now in zip(self._slot_dicts, self._slot_names, self._slot_params, current):
            if now is param:
                continue
            what = f"replaced by {type(now).__name__}" if now is not None else "removed (deleted or set to None)"
            if now is None and slots.get(f"{name}_orig") is param:  # torch.nn.utils.prune: weight -> weight_orig
                self._fail(
                    f"MixedPrecisionPlugin with master weights: parameter {self._names.get(id(param), '?')!r} was "
                    f"pruned (torch.nn.utils.prune or Lightning's ModelPruning) after setup: {PRUNING}"
                )
            if now is None:
                self._fail(self._message(param, what, "the masters need a parameter there."))
            self._check_value(param, now, f"replaced (`module.{name} = nn.Parameter(...)`)")
            slots[name] = param
            param.requires_grad_(now.requires_grad)
            values[id(param)] = now.detach()
        return values

    def _check_value(self, param: nn.Parameter, value: Tensor, what: str, keep_dtype: bool = False) -> None:
        index = self._index[id(param)]
        shape, device, dtype = self._shapes[index], self._devices[index], self._dtypes[index]
        problem = None
        if tuple(value.shape) != shape:
            problem = f"its shape is now {tuple(value.shape)}, the masters' is {shape}"
        elif not value.is_floating_point():
            problem = f"its dtype is now {value.dtype}, not a floating dtype"
        elif keep_dtype and value.dtype != dtype:
            problem = (
                f"its dtype is now {value.dtype}, not {dtype}: under DDP torch then drops the parameter's gradient "
                f"accumulator, which holds DDP's hook (assign `tensor.to({dtype})` instead)"
            )
        elif value.device != device:
            problem = f"it is now on {value.device}, its masters on {device}"
        if problem is not None:
            self._fail(self._message(param, what, problem))

    def _fail(self, message: str) -> NoReturn:
        error = ModelWriteError(message)
        error.repeated, self._raised = message == self._raised, message
        raise error

    def _message(self, param: nn.Parameter, what: str, problem: str) -> str:
        return (
            f"MixedPrecisionPlugin with master weights: parameter {self._names.get(id(param), '?')!r} was {what} "
            f"after setup, and the master weights cannot follow it: {problem}. {HOW_TO_WRITE} To change the model's "
            "structure, do it before the plugin sets the model up (before fabric.setup / in configure_model)."
        )

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No following while inside: :func:`~lightning_mp.master.exact.exact_weights` has put fp32 stand-ins into
        the modules and takes what was written into them itself on leaving."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def tracks(self, param: Tensor) -> bool:
        """Whether ``param`` is one of the converted parameters the masters belong to."""
        return id(param) in self._index

    def name_of(self, param: Tensor) -> str:
        """The parameter's qualified name in the model (its first, for tied ones)."""
        return self._names.get(id(param), "?")

    # ------------------------------------------------------------------ hooks on every owning module
    def _state_dict_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        # the module's state_dict holds the exact fp32 values under every name of a parameter (tied ones have
        # several), so it loads into a plain fp32 model with nothing lost; writes since the last step count
        self.follow()
        for name, param in self._owned.get(id(module), ()):
            if prefix + name in state_dict:
                state_dict[prefix + name] = self.store.fp32_value(param)
        for entry in self._buffers.of(module):
            if prefix + entry.name in state_dict:
                value = self._buffers.value(entry)
                if value is not None:
                    state_dict[prefix + entry.name] = value

    def _load_pre_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        # keep what the load brings (any value torch copies from, as torch's _load_from_state_dict accepts it);
        # among a tied parameter's names an fp32/fp64 value wins over a half one (older checkpoints stored the half
        # copy under the alias); the converted buffers keep theirs too
        self._buffers.before_load(module, state_dict, prefix)
        for name, param in self._owned.get(id(module), ()):
            value = state_dict.get(prefix + name)
            if value is None or not is_tensor_like(value):
                continue
            held = self._loaded.get(id(param))
            if held is None or not _is_wide(held) or _is_wide(value):
                self._loaded[id(param)] = value

    def _load_post_hook(self, module: nn.Module, incompatible_keys: Any) -> None:
        # torch has copied (rounded) the values into the model: the masters take them at full precision, and the
        # model their rounding; a load with assign=True put new objects in the module: the masters' come back
        self._buffers.after_load(module)
        with torch.no_grad():
            for name, param in self._owned.get(id(module), ()):
                value = self._loaded.pop(id(param), None)
                if value is None:
                    continue
                if self.watch_objects and module._parameters.get(name) is not param:
                    module._parameters[name] = param
                self.store.load_fp32(param, value)
                index = self._index[id(param)]
                self._versions[index] = param._version
                self.storage_generation += 1  # the load may have given the parameter new storage
                if self.watch_objects:
                    self._pointers[index] = param.data_ptr()
                    if self._held:
                        self._held[index] = param.data

    def remove(self) -> None:
        """Remove the hooks (at teardown) and stop holding the parameters (:func:`holder_of` no longer names this)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._loaded.clear()
        for param in self._held_params:
            if holder_of(param) is self:  # a later store may have converted the same model since
                del _HOLDERS[param]
        self._held_params = []


#: parameter -> weak reference to the :class:`ModelSync` that holds it (weak keys: compared by identity)
_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def holder_of(param: Tensor) -> Optional[ModelSync]:
    """The :class:`ModelSync` whose masters hold ``param`` (any parameter of the model they set up, converted or
    kept in fp32), or ``None``: no master weights hold it (none set it up, or they were torn down)."""
    ref = _HOLDERS.get(param)
    return ref() if ref is not None else None


def stop(sync: Optional[ModelSync]) -> Optional[ModelWriteError]:
    """Follow the writes since the last step, then remove ``sync``'s hooks (at teardown). A write that cannot be
    followed is returned, not raised (unless raised before already: then ``None``), so that the store gives the model
    its exact weights first and raises it then."""
    if sync is None:
        return None
    try:
        sync.follow()
    except ModelWriteError as error:
        return None if error.repeated else error
    finally:
        sync.remove()
    return None


def _is_wide(value: Any) -> bool:
    return getattr(value, "dtype", None) in (torch.float32, torch.float64)


def materialise(value: Any, shape: Any, device: torch.device) -> Tensor:
    """``value`` (a tensor or any tensor-like torch can copy from) as a new fp32 tensor of ``shape`` on ``device``."""
    return torch.empty(tuple(shape), dtype=torch.float32, device=device).copy_(value)


def start_following(masters: Any, model: Any = None) -> None:
    """Setup is over: from now on every write into ``model`` reaches ``masters`` (a no-op for masters without a
    :class:`ModelSync`). Under DDP a ``p.data = t`` of another dtype is refused: torch then drops the gradient
    accumulator that holds DDP's hook."""
    sync = getattr(masters, "model_sync", None)
    if sync is not None:
        sync.keep_dtypes = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        sync.start()


def follow_writes(masters: Any) -> None:
    """Make ``masters`` follow every write into the model since their last record (see :meth:`ModelSync.follow`)."""
    sync = getattr(masters, "model_sync", None)
    if sync is not None:
        sync.follow()
