"""Sample data: sentiment text (:class:`SentimentDataModule`), small grayscale images (:class:`ImageDataModule`) and
plain text as bytes for the language model (:class:`TextDataModule`)."""

from lightning_mp.samples.data.images import ImageDataModule
from lightning_mp.samples.data.sentiment import SentimentDataModule
from lightning_mp.samples.data.text import TextDataModule

__all__ = ["ImageDataModule", "SentimentDataModule", "TextDataModule"]
