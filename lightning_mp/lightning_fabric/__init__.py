"""The plugin for projects built on the standalone ``lightning_fabric`` package (``lightning_fabric.Fabric``).

``lightning_fabric`` holds its own copy of every Fabric class, so its ``Fabric`` refuses a plugin built on
``lightning.fabric``'s ``Precision``. Change the import, nothing else::

    import lightning_fabric
    from lightning_mp.lightning_fabric import FabricPrecisionMonitor, MixedPrecisionPlugin

    fabric = lightning_fabric.Fabric(plugins=[MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")])

:class:`MixedPrecisionPlugin` here is :class:`lightning_mp.MixedPrecisionPlugin` with ``lightning_fabric``'s
``Precision`` added as a base, and no body (see :mod:`lightning_mp.pytorch_lightning` for the why). It does not need
``pytorch_lightning``; with it installed, ``lightning_mp.pytorch_lightning.MixedPrecisionPlugin`` serves
``lightning_fabric.Fabric`` too. ``FabricPrecisionMonitor`` needs no other base (Fabric calls its callbacks' methods
by name) and is re-exported.

Importing this module imports ``lightning_fabric``; ``import lightning_mp`` never does.
"""

from __future__ import annotations

from lightning_fabric.plugins.precision import Precision as _Precision

import lightning_mp as _lightning_mp
from lightning_mp import CastPolicy, Census, DynamicLossScaler, MasterWeights, audit
from lightning_mp.diagnostics import FabricPrecisionMonitor


# the plugin's hooks take the Trainer's arguments, and Fabric's when a Fabric drives it (lightning_mp.fabric.hooks);
# lightning_fabric's Precision declares Fabric's signatures with its own copy's types, so a type checker sees them
# clash (pre_backward, post_backward, optimizer_step); at run time they are one API (see lightning_mp.standalone)
class MixedPrecisionPlugin(_lightning_mp.MixedPrecisionPlugin, _Precision):  # type: ignore[misc]
    __doc__ = _lightning_mp.MixedPrecisionPlugin.__doc__


__all__ = [
    "CastPolicy",
    "Census",
    "DynamicLossScaler",
    "FabricPrecisionMonitor",
    "MasterWeights",
    "MixedPrecisionPlugin",
    "audit",
]
