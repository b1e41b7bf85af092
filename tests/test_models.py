"""The sample ResNet's two stems: the small-image one keeps the resolution, the ImageNet one divides it by 4."""

import pytest
import torch

from lightning_mp.models.resnet import ResNet


@pytest.mark.parametrize(("stem", "size", "stem_out", "last"), [("small", 28, 28, 4), ("imagenet", 224, 56, 7)])
def test_stem_sets_the_resolution_of_the_first_stage(stem, size, stem_out, last):
    model = ResNet(depth=10, num_classes=7, in_channels=3, width=4, stem=stem)
    images = torch.randn(2, 3, size, size)
    assert model.stem(images).shape == (2, 4, stem_out, stem_out)
    # three stride-2 stages follow (each ceil(n / 2)): ResNet-18 at 224 ends on the 7x7 map of He et al.
    assert model.blocks(model.stem(images)).shape == (2, 32, last, last)
    assert model(images).shape == (2, 7)


def test_unknown_stem_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match=r"stem='cifar' is not supported: use 'small' or 'imagenet'"):
        ResNet(stem="cifar")
