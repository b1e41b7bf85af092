"""``MixedPrecisionCallback``: the plugin for a Trainer that a project builds itself, with a precision flag of its own.

Some projects build the Trainer from their own arguments and always pass ``precision=``: darts fills in ``"32-true"``
for float32 series (``"64-true"`` for float64, or whatever Trainer's ``precision`` it saw last) and pytorch_tabular
passes ``TrainerConfig.precision`` (default ``"32"``, and ``None`` is refused by its schema). Lightning refuses a
precision plugin next to any ``precision=`` (``ValueError: Received both `precision=32-true` and `plugins=...`.
Choose one``) before a plugin is asked anything, so ``plugins=[MixedPrecisionPlugin(...)]`` cannot reach those
Trainers. What they all pass through is a list of callbacks (darts: ``pl_trainer_kwargs={"callbacks": [...]}``,
pytorch_tabular: ``TabularModel.fit(..., callbacks=[...])``), and both keep that list for the Trainers they build
later (darts' predict and reloaded models, pytorch_tabular's ``evaluate`` and ``load_model``).

The callback holds the plugin's arguments, not a plugin. In ``setup``, the first hook of every run (fit, validate,
test, predict) and one that Lightning calls before the strategy converts the model, connects the optimizers or
restores a checkpoint, it builds a plugin from them and sets it as the Trainer's ``strategy.precision_plugin`` (the
strategy's public setter, as Lightning's own connector does). What it takes the place of is checked: Lightning's
plain ``Precision`` (``"32-true"``, the projects' default) or a built-in ``MixedPrecision`` that repeats the
callback's own precision (``"bf16-mixed"`` with ``MixedPrecisionCallback("bf16-mixed")``); anything else (``"64-true"``,
``"bf16-true"``, another mixed precision, a plugin given twice) is refused with what to change. A Trainer keeps the
plugin it was given for all its runs (a ``fit`` then a ``test`` on one Trainer share one plugin, and its scaler); each
new Trainer gets a new one, as each gets a new built-in precision. The plugin of the latest Trainer is
:attr:`MixedPrecisionCallback.plugin`.

The callback pickles as its arguments (the plugin is dropped), so a project that saves its callbacks with the model
(darts' ``model.save``, pytorch_tabular's ``save_model``) reloads a model that trains and predicts with the plugin
again. :mod:`lightning_mp.pytorch_lightning` has the same callback for the standalone ``pytorch_lightning`` Trainer
(darts and pytorch_tabular), building that package's plugin.
"""

from __future__ import annotations

import weakref
from typing import Any, ClassVar

import lightning.pytorch as L
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from typing_extensions import override

from lightning_mp.diagnostics import PrecisionMonitor
from lightning_mp.plugin import MixedPrecisionPlugin, PrecisionName
from lightning_mp.standalone import lightning_isinstance, lightning_name, trainer_callbacks

#: the precision plugins the callback takes the place of: Lightning's default, and its own mixed precision when the
#: flag repeats the callback's precision (checked by name, so that both Lightning packages' classes count)
_DEFAULT = lightning_name(Precision)
_BUILT_IN_MIXED = lightning_name(MixedPrecision)
#: what a pickle of the callback leaves out: its plugins, and the LightningModule's ``log``/``log_dict`` that Lightning
#: attaches to every callback during a run
_NOT_PICKLED = ("plugin", "_installed", "log", "log_dict")


class MixedPrecisionCallback(L.Callback):
    """:class:`~lightning_mp.MixedPrecisionPlugin` as a callback, for a Trainer built by a project that always passes
    its own ``precision=`` (darts, pytorch_tabular): Lightning refuses a precision plugin next to any precision flag.

    Args:
        precision: the plugin's ``precision`` (``"16-mixed"``, the default, or ``"bf16-mixed"``).
        **options: the plugin's other arguments (``master_weights="remainder"``, ``scaler=``, ``policy=``, ...),
            checked now: a bad value raises here, not at the first fit. Plain values (strings, numbers, mappings)
            keep the callback picklable by the projects' safe loaders.

    In each Trainer's ``setup`` it builds ``plugin_class(precision, **options)`` and makes it the Trainer's precision
    plugin, in place of Lightning's default ``Precision`` (``"32-true"``/``"32"``) or of a built-in ``MixedPrecision``
    with the same precision; it refuses any other precision the Trainer was built with, a Trainer that already has a
    ``MixedPrecisionPlugin``, and a :class:`~lightning_mp.PrecisionMonitor` listed before it (the monitor reads the
    plugin in its own ``setup``). A Trainer keeps its plugin for all its runs; :attr:`plugin` is the latest Trainer's.
    Subclass and set :attr:`plugin_class` to install a subclass of the plugin.
    """

    #: the plugin class built for each Trainer (``lightning_mp.pytorch_lightning``'s callback builds that package's)
    plugin_class: ClassVar[type[MixedPrecisionPlugin]] = MixedPrecisionPlugin

    def __init__(self, precision: PrecisionName = "16-mixed", **options: Any) -> None:
        self.plugin_class(precision, **options)  # the plugin's own checks, now rather than at the first fit
        self.precision = precision
        self.options = dict(options)
        self.plugin: MixedPrecisionPlugin | None = None  # the plugin of the latest Trainer set up (not pickled)
        self._installed: weakref.WeakSet[MixedPrecisionPlugin] = weakref.WeakSet()  # every Trainer's, while alive

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # the first hook of a run, before strategy.setup converts the model and connects the optimizers: the plugin
        # is in place for everything the precision plugin does in this run, and for a checkpoint's plugin state
        current = trainer.strategy.precision_plugin
        if current in self._installed:
            return  # a later run of a Trainer set up before: it keeps its plugin, as it keeps a built-in one
        self._check_replaceable(current)
        self._check_monitors_follow(trainer)
        self.plugin = self.plugin_class(self.precision, **self.options)
        self._installed.add(self.plugin)
        trainer.strategy.precision_plugin = self.plugin

    def _check_replaceable(self, current: Any) -> None:
        if lightning_isinstance(current, MixedPrecisionPlugin):
            raise ValueError(
                f"{self!r}: this Trainer already has {current!r} (from plugins=[...]). Pass the plugin one way: "
                "drop the plugin from the Trainer's plugins, or drop this callback."
            )
        name = lightning_name(type(current))
        if name == _DEFAULT or (name == _BUILT_IN_MIXED and getattr(current, "precision", None) == self.precision):
            return
        flag = getattr(current, "precision", "?")
        raise ValueError(
            f"{self!r} takes the place of the Trainer's default precision ('32-true') or of one that repeats its own "
            f"({self.precision!r}); this Trainer was built with {type(current).__name__} (precision={flag!r}). Build "
            "it without that precision: darts sets '64-true' for float64 series and 'bf16-true' for float16 ones "
            "(pass `series.astype(np.float32)`), and copies the precision of a Trainer passed to fit(trainer=...) "
            "(pass the callback instead); pytorch_tabular takes TrainerConfig(precision=...) (leave it at '32')."
        )

    def _check_monitors_follow(self, trainer: L.Trainer) -> None:
        callbacks = list(trainer_callbacks(trainer))
        mine = next((index for index, callback in enumerate(callbacks) if callback is self), len(callbacks))
        early = [type(c).__name__ for c in callbacks[:mine] if lightning_isinstance(c, PrecisionMonitor)]
        if early:
            raise ValueError(
                f"{early[0]} is listed before {type(self).__name__} in the Trainer's callbacks: it reads the precision "
                f"plugin in its own setup, before this callback installs it. List {type(self).__name__} first."
            )

    def __getstate__(self) -> dict[str, Any]:
        # the arguments, without the plugins of this process's Trainers nor the module's log/log_dict that Lightning
        # sets on every callback during a run (a pickle of them is one of the whole model): a saved model (darts'
        # model.save, pytorch_tabular's save_model) builds a new plugin for each Trainer after loading, as before
        return {key: value for key, value in self.__dict__.items() if key not in _NOT_PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.plugin = None
        self._installed = weakref.WeakSet()

    def __repr__(self) -> str:
        options = "".join(f", {key}={value!r}" for key, value in self.options.items())
        return f"{type(self).__name__}({self.precision!r}{options})"
