"""Sample LightningModules trained by the CLI: a BERT-family sentiment classifier and a small-image ResNet."""

from lightning_mp.samples.models.bert import BertClassifier
from lightning_mp.samples.models.resnet import ResNet, ResNetClassifier

__all__ = ["BertClassifier", "ResNet", "ResNetClassifier"]
