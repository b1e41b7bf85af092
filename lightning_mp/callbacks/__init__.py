"""The plugin carried by a callback, where a project's Trainer takes no precision plugin: on top of the plugin.

- :mod:`lightning_mp.callbacks.precision_callback`: ``MixedPrecisionCallback`` installs the plugin in Trainers that a
  project builds with a precision flag of its own (darts, pytorch_tabular), through the callbacks they pass on.

What Lightning's own averaging callbacks need of the plugin is below it, in :mod:`lightning_mp.averaging` (the plugin
imports it; this package imports the plugin, so the two never use each other).
"""
