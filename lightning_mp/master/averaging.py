"""Lightning's weight-averaging callbacks over the exact master weights.

Lightning 2.6's ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging`` and any subclass) read
``pl_module.parameters()`` to update their averaged model and write the average back into them (``.data.copy_`` at
train end and around validation, ``detach().copy_`` for SWA). With master weights those parameters are 16-bit copies:
the average would be one of rounded values, and the write-back would miss the masters (``.data.copy_`` is invisible
to them). Their averaged model itself is fp32: they copy the LightningModule in ``setup``, before the plugin converts
it (4 bytes per parameter, as with the built-in plugin).

:func:`adapt_averaging_callbacks` runs each of their hooks that reads or writes the model inside
:func:`~lightning_mp.master.exact.exact_weights`: the callback sees fp32 parameters holding the exact values, and what
it writes into them becomes the masters exactly. The callback objects are otherwise untouched; the hooks are put back
at teardown.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_mp.master.exact import exact_weights

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


def adapt_averaging_callbacks(module: Any, store: Any) -> list[Any]:
    """Run the model-reading and -writing hooks of Lightning's averaging callbacks of the Trainer that fits
    ``module`` over the exact weights of ``store`` (see module doc). Returns the callbacks adapted (each says so once,
    on rank 0); none without master weights (``store`` ``None``) or a Trainer (Fabric has no such callbacks)."""
    adapted: list[Any] = []
    if store is None:
        return adapted
    for callback in getattr(getattr(module, "_trainer", None), "callbacks", None) or ():
        for name, cls in _averaging_classes().items():
            if not isinstance(callback, cls) or getattr(callback, _MARK, None):
                continue
            wrapped = []
            for hook, writes in _HOOKS[name].items():
                own = getattr(cls, hook)
                # a subclass's own version of a read-only hook may write: it gets the write-back too
                write = writes or getattr(type(callback), hook) is not own
                setattr(callback, hook, _over_exact_weights(getattr(callback, hook), store, write))
                wrapped.append(hook)
            setattr(callback, _MARK, wrapped)
            adapted.append(callback)
            rank_zero_info(
                f"MixedPrecisionPlugin: {type(callback).__name__} averages the exact fp32 master weights: its reads of "
                "the model and its write-back run inside lightning_mp.master.exact_weights."
            )
    return adapted


def restore_averaging_callbacks(callbacks: list[Any]) -> None:
    """Put back the hooks :func:`adapt_averaging_callbacks` wrapped (at teardown)."""
    for callback in callbacks:
        for hook in callback.__dict__.pop(_MARK, ()):
            callback.__dict__.pop(hook, None)


def _over_exact_weights(hook: Callable[..., Any], store: Any, write: bool) -> Callable[..., Any]:
    @functools.wraps(hook)
    def run(trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> Any:
        with exact_weights(pl_module, store=store, write=write):
            return hook(trainer, pl_module, *args, **kwargs)

    return run
