"""Lightning's classes come in two copies: ``lightning.pytorch`` / ``lightning.fabric`` (the ``lightning`` package) and
the standalone ``pytorch_lightning`` / ``lightning_fabric`` packages, which Lightning builds from the same sources by
renaming the imports. The copies are different classes: ``pytorch_lightning.strategies.DDPStrategy`` is not a
``lightning.pytorch.strategies.DDPStrategy``. Where the library asks what a Lightning object is (a strategy, a
``LightningModule``, a ``Fabric``), it asks :func:`lightning_isinstance`, which answers the same for both copies.

Why a question asked this way, and not a copy of the library per package. The plugin is the same object under both
packages; what differs is which ``Precision`` / ``Callback`` base class the standalone Trainer or Fabric accepts.
:mod:`lightning_mp.pytorch_lightning` and :mod:`lightning_mp.lightning_fabric` add that base to the same classes (a
subclass each, no body), so a run's numerics objects (``DynamicLossScaler``, ``CastPolicy``, master weights) and
checkpoints (the plugin's state under the key ``"MixedPrecisionPlugin"``) are shared by both packages. The other
way, Lightning's own (rename ``lightning.pytorch`` to ``pytorch_lightning`` in the source, applied at import time),
would load a second copy of every module that imports Lightning, and of every module that imports those: most of
the library, with its classes twice. The price of this way: every type question about a Lightning object in the
library goes through :func:`lightning_isinstance`, and a base method of Lightning's ``Precision`` that asks one
itself is overridden in the plugin (``_clip_gradients``); ``tests/test_standalone_packages.py`` runs each mode under
both packages and compares the weights bit for bit, which is what catches a question asked the other way.

Nothing here imports ``pytorch_lightning`` or ``lightning_fabric``: a class is recognised by its module path and
qualified name, the standalone package's path read as ``lightning``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar, Union, overload

if TYPE_CHECKING:
    import lightning.pytorch as pl

_T = TypeVar("_T")

#: the standalone packages' module prefixes, and the ``lightning`` package's module prefix each one copies
_STANDALONE = {"pytorch_lightning": "lightning.pytorch", "lightning_fabric": "lightning.fabric"}


def lightning_name(cls: type) -> str:
    """``module.qualname`` of ``cls`` with a standalone package's module path read as ``lightning``'s
    (``pytorch_lightning.strategies.ddp.DDPStrategy`` -> ``lightning.pytorch.strategies.ddp.DDPStrategy``)."""
    module = cls.__module__
    top, _, rest = module.partition(".")
    if top in _STANDALONE:
        module = _STANDALONE[top] + ("." + rest if rest else "")
    return f"{module}.{cls.__qualname__}"


@overload
def lightning_isinstance(obj: Any, classes: type[_T]) -> TypeGuard[_T]: ...


@overload
def lightning_isinstance(obj: Any, classes: tuple[type, ...]) -> bool: ...


def lightning_isinstance(obj: Any, classes: Union[type, tuple[type, ...]]) -> bool:
    """``isinstance(obj, classes)`` for classes of the ``lightning`` package, true as well when ``obj`` is an instance
    of the same class from ``pytorch_lightning`` / ``lightning_fabric`` (or of a subclass of it). For one class, a
    type checker takes ``obj`` for an instance of it: the standalone package's copy offers the same members.

    Asked at setup, not per step: it walks ``type(obj).__mro__`` once when plain ``isinstance`` says no.
    """
    classes = classes if isinstance(classes, tuple) else (classes,)
    if isinstance(obj, classes):
        return True
    wanted = {lightning_name(cls) for cls in classes}
    return any(lightning_name(cls) in wanted for cls in type(obj).__mro__)


def trainer_callbacks(trainer: pl.Trainer) -> list[pl.Callback]:
    """``trainer.callbacks``, the Trainer's callbacks in the order Lightning calls them (either package's Trainer)."""
    # set in the Trainer's __init__ by Lightning's callback connector; the Trainer class does not declare it
    return trainer.callbacks  # type: ignore[attr-defined]
