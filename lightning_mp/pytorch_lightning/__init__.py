"""The plugin and the monitor for projects built on the standalone ``pytorch_lightning`` package.

``pytorch_lightning`` holds its own copy of every Lightning class, so its Trainer refuses a plugin built on
``lightning.pytorch``'s ``Precision`` (``MisconfigurationException: Found invalid type for plugin ...``) and a
callback built on ``lightning.pytorch``'s ``Callback``. Change the import, nothing else::

    import pytorch_lightning as pl
    from lightning_mp.pytorch_lightning import MixedPrecisionPlugin, PrecisionMonitor

    trainer = pl.Trainer(plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")],
                         callbacks=[PrecisionMonitor()])

The classes here are :class:`lightning_mp.MixedPrecisionPlugin` and :class:`lightning_mp.PrecisionMonitor` with the
standalone package's base added, and no body: every option and feature is the same code, the checkpoint key is the
same (``"MixedPrecisionPlugin"``: a run moves between both packages), and the plugin also serves
``lightning_fabric.Fabric`` (``pytorch_lightning``'s ``Precision`` is a ``lightning_fabric`` one). Where the library
asks what a Lightning object is, it accepts both packages' classes: see :mod:`lightning_mp.standalone`. The numerics
objects (:class:`~lightning_mp.DynamicLossScaler`, :class:`~lightning_mp.CastPolicy`, master weights) are the same
classes as in ``lightning_mp`` and are re-exported here for one import line.

Projects that build the Trainer themselves and always pass ``precision=`` (darts, pytorch_tabular), where Lightning
refuses a precision plugin next to it, take :class:`MixedPrecisionCallback` in their callbacks instead: the same plugin,
installed in each Trainer they build (:mod:`lightning_mp.callbacks.precision_callback`).

Importing this module imports ``pytorch_lightning``; ``import lightning_mp`` never does.
"""

from __future__ import annotations

import pytorch_lightning as _pl
from lightning_fabric.plugins import TorchCheckpointIO as _TorchCheckpointIO
from pytorch_lightning.plugins.precision import Precision as _Precision

import lightning_mp as _lightning_mp
from lightning_mp import CastPolicy, Census, DynamicLossScaler, MasterWeights, audit
from lightning_mp.callbacks.precision_callback import MixedPrecisionCallback as _MixedPrecisionCallback
from lightning_mp.checkpoints.io import CPUMapLocation as _CPUMapLocation
from lightning_mp.diagnostics import FabricPrecisionMonitor


# the two bases are two copies of Lightning's classes (lightning's, the standalone package's): each hook's
# signature names its own copy's types (Trainer, LightningModule), so a type checker sees them clash; at run time
# they are one API (see lightning_mp.standalone)
class MixedPrecisionPlugin(_lightning_mp.MixedPrecisionPlugin, _Precision):  # type: ignore[misc]
    __doc__ = _lightning_mp.MixedPrecisionPlugin.__doc__


class PrecisionMonitor(_lightning_mp.PrecisionMonitor, _pl.Callback):  # type: ignore[misc]  # (as above)
    __doc__ = _lightning_mp.PrecisionMonitor.__doc__


class TensorSubclassCheckpointIO(_CPUMapLocation, _TorchCheckpointIO):
    """:class:`lightning_mp.TensorSubclassCheckpointIO` on the standalone package's ``TorchCheckpointIO``."""


class MixedPrecisionCallback(_MixedPrecisionCallback, _pl.Callback):  # type: ignore[misc]  # (as above)
    __doc__ = _MixedPrecisionCallback.__doc__
    plugin_class = MixedPrecisionPlugin  # this package's plugin: a pytorch_lightning Trainer takes only that one


__all__ = [
    "CastPolicy",
    "Census",
    "DynamicLossScaler",
    "FabricPrecisionMonitor",
    "MasterWeights",
    "MixedPrecisionCallback",
    "MixedPrecisionPlugin",
    "PrecisionMonitor",
    "TensorSubclassCheckpointIO",
    "audit",
]
