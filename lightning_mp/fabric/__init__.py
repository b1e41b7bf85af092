"""Lightning Fabric: the same :class:`~lightning_mp.MixedPrecisionPlugin` in ``L.Fabric(plugins=[...])``.

Fabric calls a ``Precision`` plugin through other hooks than the Trainer: ``pre_backward(tensor, module)`` and
``post_backward`` with no Trainer behind the module (often no module at all), ``backward(tensor, model, *args)``
with no optimizer, ``optimizer_step(optimizer, **kwargs)`` with no closure and no model, ``unscale_gradients`` and
``main_params`` from ``fabric.clip_gradients``, and no ``connect``: no hook sees the optimizers next to the model.
One class serves both: :class:`FabricHooks` (a base of the plugin, before Lightning's ``Precision``) does Fabric's
part of each hook when a Fabric drives the plugin and defers to Lightning's otherwise; the numerics (scaler, masters,
policy, strategies' syncs, the step of :mod:`lightning_mp.stepping`) are the Trainer path's, called the same way.

Where the masters connect. ``fabric.setup(model, optimizer)`` (and ``fabric.setup_module``) calls the plugin's
``convert_module`` first: with master weights the model is cast to half there, in place, and its parameters keep
their identity, so the optimizer the user built before ``setup`` holds the half parameters, as an optimizer built
by the Trainer's ``configure_optimizers`` does. ``convert_module`` finds the Fabric that calls it (its caller's
frame) and, on that Fabric's strategy object only, :class:`FabricDriver` wraps ``setup_module``,
``setup_optimizer``, ``setup_module_and_optimizers``, ``optimizer_step``, the two clipping methods and
``save_checkpoint`` / ``load_checkpoint``. As soon as the strategy has set up the module (a DDP wrapper, FSDP2
shards) and the optimizers, the plugin's ``connect`` runs as under the Trainer: fp32 masters are built from the
exact fp32 values kept at the cast and put into the user's optimizer's ``param_groups`` in place (lean masters keep
the optimizer as it is). That happens inside ``fabric.setup`` (or ``fabric.setup_optimizers``), before any
``fabric.load``, so saved optimizer state loads onto the masters. A module set up without optimizers connects at
its first forward.

Checkpoints: ``fabric.save(path, state)`` adds the plugin's state (the scaler's) under the key
``"MixedPrecisionPlugin"`` (the class's name, as in a Trainer's checkpoint) unless ``state`` already holds the
plugin; ``fabric.load(path, state)`` restores it from there and leaves it out of what it returns. The model's
entries are the fp32 master values (the masters' state-dict hooks), which load strictly into an fp32 model.
"""

from lightning_mp.fabric.driver import WRAPPED, FabricDriver
from lightning_mp.fabric.hooks import FabricHooks, fabric_calling

__all__ = ["WRAPPED", "FabricDriver", "FabricHooks", "fabric_calling"]
