"""The plugin and Lightning's callbacks: what Lightning's own callbacks need from the plugin (as ``distributed/`` is
what its strategies need), and the plugin carried by a callback where a project's Trainer takes no precision plugin.

- :mod:`lightning_mp.callbacks.averaging`: ``StochasticWeightAveraging`` and ``WeightAveraging``/``EMAWeightAveraging``
  run over the exact master weights (the plugin adapts them when it connects).
- :mod:`lightning_mp.callbacks.precision_callback`: ``MixedPrecisionCallback`` installs the plugin in Trainers that a
  project builds with a precision flag of its own (darts, pytorch_tabular), through the callbacks they pass on.
"""
