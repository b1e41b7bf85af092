"""What checkpoints written and read through Lightning need of the library, beside the plugin's own state.

- :mod:`lightning_mp.checkpoints.io`: ``TensorSubclassCheckpointIO``, Lightning's checkpoint IO that loads tensor
  subclasses (torchao's 8-bit optimizer state), and the words of torch's refusal without it.
"""

from lightning_mp.checkpoints.io import REFUSAL, TensorSubclassCheckpointIO

__all__ = ["REFUSAL", "TensorSubclassCheckpointIO"]
