"""Sample LightningModules trained by the CLI: a BERT-family sentiment classifier, a small-image ResNet and a small
GPT-style causal language model."""

from lightning_mp.samples.models.bert import BertClassifier
from lightning_mp.samples.models.gpt import GPT, GPTLanguageModel
from lightning_mp.samples.models.resnet import ResNet, ResNetClassifier

__all__ = ["BertClassifier", "GPT", "GPTLanguageModel", "ResNet", "ResNetClassifier"]
