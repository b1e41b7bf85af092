"""``toggle_optimizer`` / ``untoggle_optimizer`` with fp32 masters act on the model's parameters, as under Lightning's
built-in precision.

Lightning's ``LightningModule.toggle_optimizer(optimizer)`` (manual optimization with several optimizers: the GAN
recipe) sets ``requires_grad = False`` on every parameter in every optimizer's param groups and gives the toggled
optimizer's parameters their ``requires_grad`` back; ``untoggle_optimizer`` restores the others. With
``master_weights=True`` the groups hold the fp32 masters, so it would switch the masters, which no forward reads,
and leave the model's parameters trainable: the discriminator would take the generator loss's gradients.
:func:`follow_toggles` wraps both methods on the module (instance attributes, the class's own methods called inside,
so an override of them in the user's class runs too) so that, while they run, the groups hold the model's parameters:
the ``requires_grad`` they set is the model's, and ``untoggle_optimizer`` finds the parameters ``toggle_optimizer``
recorded. ``toggled_optimizer`` (the context manager) calls them. Lean masters (``"remainder"``) keep the model's
parameters in the groups: nothing to do.
"""

from __future__ import annotations

import functools
from typing import Any

#: The LightningModule methods that read the optimizers' groups as the model's parameters.
TOGGLES = ("toggle_optimizer", "untoggle_optimizer")


def follow_toggles(module: Any, masters: Any) -> None:
    """Wrap ``module``'s toggle methods (a LightningModule under a Trainer) for ``masters``' fp32 masters."""
    if getattr(module, "_trainer", None) is None or not callable(getattr(module, "toggle_optimizer", None)):
        return
    for name in TOGGLES:
        module.__dict__[name] = functools.partial(_on_model_parameters, getattr(type(module), name), module, masters)


def unfollow_toggles(module: Any) -> None:
    """Remove the wrappers (at teardown)."""
    for name in TOGGLES:
        if isinstance(getattr(module, "__dict__", {}).get(name), functools.partial):
            del module.__dict__[name]


def _on_model_parameters(method: Any, module: Any, masters: Any, optimizer: Any) -> Any:
    """``method(module, optimizer)`` while every param group of the Trainer's optimizers (and ``optimizer``'s) holds
    the model's parameters in place of their masters; the groups hold the masters again after it."""
    param_of = {id(master): param for param, master in masters.pairs()}
    groups = {id(g): g for opt in [*module.trainer.optimizers, optimizer] for g in opt.param_groups}.values()
    saved = [(group, group["params"]) for group in groups]
    for group, params in saved:
        group["params"] = [param_of.get(id(p), p) for p in params]
    try:
        return method(module, optimizer)
    finally:
        for group, params in saved:
            group["params"] = params
