"""What Lightning's own callbacks need from the plugin, as ``distributed/`` is what its strategies need.

- :mod:`lightning_mp.callbacks.averaging`: ``StochasticWeightAveraging`` and ``WeightAveraging``/``EMAWeightAveraging``
  run over the exact master weights (the plugin adapts them when it connects).
"""
