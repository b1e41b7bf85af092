"""Lightning's weight-averaging callbacks over the exact master weights.

Lightning 2.6's ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging`` and any subclass) read
``pl_module.parameters()`` to update their averaged model and write the average back into them (``.data.copy_`` at
train end and around validation, ``detach().copy_`` for SWA). With master weights those parameters are 16-bit copies:
the average would be one of rounded values, and the write-back would miss the masters (``.data.copy_`` is invisible
to them). Their averaged model itself is fp32: they copy the LightningModule in ``setup``, before the plugin converts
it (4 bytes per parameter, as with the built-in plugin).

:func:`adapt_averaging_callbacks` runs each of their hooks that reads or writes the model inside
:func:`~lightning_mp.master.exact.exact_weights`: the callback sees fp32 parameters holding the exact values, and what
it writes into them becomes the masters exactly. ``WeightAveraging``'s own per-step and per-epoch hooks read the model
only in ``AveragedModel.update_parameters``, when ``should_update`` says so: that call is wrapped instead (read only),
so a step without an update makes no exact weights. The callback objects are otherwise untouched; the wrappers are
removed at teardown.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mp.master.exact import exact_weights
from lightning_mp.master.plain import PlainWeights

#: per callback class: hook name -> whether Lightning's own hook writes the model (False: read only)
_HOOKS = {
    "WeightAveraging": {
        "on_train_batch_end": False,
        "on_train_epoch_end": False,
        "on_train_end": True,
        "on_validation_epoch_start": True,
        "on_validation_epoch_end": True,
    },
    "StochasticWeightAveraging": {"on_train_epoch_start": True, "on_train_end": True},
}
_MARK = "_lightning_mp_exact_hooks"  # the hook names wrapped on a callback object


def _averaging_classes() -> dict[str, type]:
    from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging

    return {"WeightAveraging": WeightAveraging, "StochasticWeightAveraging": StochasticWeightAveraging}


def adapt_averaging_callbacks(module: Any, store: PlainWeights) -> list[Any]:
    """Run the model-reading and -writing hooks of Lightning's averaging callbacks of the Trainer that fits
    ``module`` over the exact weights of ``store`` (the weights interface, :mod:`lightning_mp.master.plain`; see
    module doc). Returns the callbacks adapted (each says so once, on rank 0); none without master weights (weights
    that hold no masters: the parameters are the exact weights) or a Trainer (Fabric has no such callbacks)."""
    adapted: list[Any] = []
    # a store made for FSDP2 (its sharded lean masters, or the strategy's own fp32 shards) has single_device:
    # Lightning's callbacks do not support sharded models (SWA refuses FSDP1, WeightAveraging warns)
    if not store.holds_masters or hasattr(store, "single_device"):
        return adapted
    for callback in getattr(getattr(module, "_trainer", None), "callbacks", None) or ():
        for name, cls in _averaging_classes().items():
            if not isinstance(callback, cls) or getattr(callback, _MARK, None):
                continue
            wrapped = []
            for hook, writes in _HOOKS[name].items():
                own = getattr(type(callback), hook) is getattr(cls, hook)
                if not writes and own and _wrap_update(callback, store):
                    continue  # Lightning's own per-step hook: only its updates read the model (see _wrap_update)
                # a subclass's own version of a read-only hook may write: it gets the write-back too
                setattr(callback, hook, _over_exact_weights(getattr(callback, hook), store, writes or not own))
                wrapped.append(hook)
            setattr(callback, _MARK, wrapped)
            adapted.append(callback)
            rank_zero_info(
                f"MixedPrecisionPlugin: {type(callback).__name__} averages the exact fp32 master weights: its reads of "
                "the model and its write-back run inside lightning_mp.master.exact_weights."
            )
    return adapted


def _wrap_update(callback: Any, store: PlainWeights) -> bool:
    """``WeightAveraging``'s per-step and per-epoch hooks read the model only in ``AveragedModel.update_parameters``
    when ``should_update`` says so: that call runs over the exact weights, not every step (with ``"remainder"`` each
    entry joins the whole model). Whether the averaged model (made in the callback's ``setup``) could be wrapped."""
    average = getattr(callback, "_average_model", None)
    update = getattr(average, "update_parameters", None)
    if update is None:
        return False
    if getattr(update, _MARK, False):
        return True  # the other hook wrapped it already

    @functools.wraps(update)
    def run(model: Any) -> Any:
        with exact_weights(model, store=store, write=False):
            return update(model)

    setattr(run, _MARK, True)
    object.__setattr__(average, "update_parameters", run)
    return True


def restore_averaging_callbacks(callbacks: list[Any]) -> None:
    """Put back the hooks :func:`adapt_averaging_callbacks` wrapped (at teardown)."""
    for callback in callbacks:
        for hook in callback.__dict__.pop(_MARK, ()):
            callback.__dict__.pop(hook, None)
        average = getattr(callback, "_average_model", None)
        if average is not None:
            average.__dict__.pop("update_parameters", None)


def _over_exact_weights(hook: Callable[..., Any], store: PlainWeights, write: bool) -> Callable[..., Any]:
    @functools.wraps(hook)
    def run(trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> Any:
        with exact_weights(pl_module, store=store, write=write):
            return hook(trainer, pl_module, *args, **kwargs)

    return run
