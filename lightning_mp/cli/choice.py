"""``PrecisionChoice``: what ``trainer.precision``, ``trainer.plugins`` and ``mixed_precision`` train with, and why
(made by :func:`lightning_mp.cli.app.choose_precision`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_mp.plugin import MixedPrecisionPlugin


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``trainer.precision``, ``trainer.plugins`` and the ``mixed_precision`` section train with here.

    Attributes:
        requested: ``trainer.precision`` as given (``None``: not given).
        trains: what trains: ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, another Lightning precision, or
            ``"trainer.plugins"`` (a precision plugin given there, used as configured).
        reason: why, in one sentence.
        plugin: the plugin the CLI adds to the Trainer (``None``: it adds none).
        options: the ``mixed_precision`` options as given (plain values).
        unused: the options that were set but do not apply to what trains.
        warning: what the CLI warns about at start-up (a fallback, unused options), or ``None``.
        fallback: whether the CPU fallback chose ``trains`` instead of ``requested`` (another machine may choose
            otherwise).
    """

    requested: Optional[str]
    trains: str
    reason: str
    plugin: Optional[MixedPrecisionPlugin] = None
    options: dict[str, Any] = field(default_factory=dict)
    unused: tuple[str, ...] = ()
    warning: Optional[str] = None
    fallback: bool = False

    def what(self, verb: str = "trains", full: bool = False) -> str:
        """``"<verb> in bf16-mixed with MixedPrecisionPlugin"`` and the like (``full``: the plugin's settings too)."""
        if self.plugin is not None:
            shown = repr(self.plugin) if full else "MixedPrecisionPlugin"
            return f"{verb} in {self.trains} with {shown}"
        if self.trains == "trainer.plugins":
            return f"{verb} with the precision plugin in trainer.plugins"
        return f"{verb} in {self.trains} without MixedPrecisionPlugin"

    def describe(self, verb: str = "trains") -> str:
        """One sentence starting with ``verb``: what trains and why."""
        return f"{self.what(verb)}: {self.reason}"
