"""Sample data: sentiment text (:class:`SentimentDataModule`) and small grayscale images (:class:`ImageDataModule`)."""

from lightning_mp.samples.data.images import ImageDataModule
from lightning_mp.samples.data.sentiment import SentimentDataModule

__all__ = ["ImageDataModule", "SentimentDataModule"]
