"""The lean step inside backward (``optimizer_in_backward=True``), one module per part.

- :mod:`~lightning_mp.master.in_backward.hooks`: :class:`StepInBackward`, the per-parameter hooks that update each
  parameter as soon as its gradient is final, and the checks of setup (:func:`check_options`, :func:`check_setup`,
  :func:`check_strategy`, :func:`install`);
- :mod:`~lightning_mp.master.in_backward.flags`: the non-finite flags, one device vector;
- :mod:`~lightning_mp.master.in_backward.regions`: reentrant checkpoint regions (an update waits for its gradient);
- :mod:`~lightning_mp.master.in_backward.changes`: param groups and options followed, later hooks refused;
- :mod:`~lightning_mp.master.in_backward.settings`: the refusal's one shape and the Trainer's settings it reads;
- :mod:`~lightning_mp.master.in_backward.zero_grads`: ``zero_grad(set_to_none=False)`` inside backward;
- :mod:`~lightning_mp.master.in_backward.loop`: the rules each loop meets (one backward per step, clipping).
"""

from lightning_mp.master.in_backward.hooks import StepInBackward, check_options, check_setup, check_strategy, install
from lightning_mp.master.in_backward.settings import OPTION, refusal

__all__ = ["OPTION", "StepInBackward", "check_options", "check_setup", "check_strategy", "install", "refusal"]
