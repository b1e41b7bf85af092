"""The command line: ``python -m lightning_mp fit --config configs/bert.yaml``.

- :mod:`lightning_mp.cli.app`: :class:`MixedPrecisionCLI` (a ``LightningCLI``) and :func:`main`;
- :mod:`lightning_mp.cli.checks`: option, strategy and checkpoint checks that fail in one line before any work;
- :mod:`lightning_mp.cli.errors`: command-line parse errors said in one line, with the bad key and what is allowed;
- :mod:`lightning_mp.cli.choice`: ``PrecisionChoice``, what trains and why;
- :mod:`lightning_mp.cli.report`: the end-of-fit summary and ``--print_config``;
- :mod:`lightning_mp.cli.checkpoints`: :class:`LastCheckpoint`, the ``last.ckpt`` that resumes exactly;
- :mod:`lightning_mp.cli.consolidate`: ``python -m lightning_mp consolidate``, a (sharded) checkpoint as one fp32 file.
- :mod:`lightning_mp.cli.run_folder`: a run that fails before writing into its log folder leaves no folder behind.

An application of the library: nothing in the library imports it.
"""

from lightning_mp.cli.app import MixedPrecisionCLI, main
from lightning_mp.cli.checkpoints import LastCheckpoint
from lightning_mp.cli.choice import choose_precision, cpu_has_native_bf16, plugin_for

__all__ = ["LastCheckpoint", "MixedPrecisionCLI", "choose_precision", "cpu_has_native_bf16", "main", "plugin_for"]
