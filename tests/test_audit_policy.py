"""The casting policy as the audit sees it: the BERT sample model under different policies."""

import pytest
import torch

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.diagnostics import audit
from lightning_mp.samples.models import BertClassifier

TINY_BERT = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128)


# ---------------------------------------------------------------------- the BERT sample under the policy
def _bert_census(policy=None, declared=None):
    torch.manual_seed(0)
    model = BertClassifier(pretrained=False, config_overrides=TINY_BERT)
    if declared is not None:
        model.configure_precision_policy = lambda: declared
    plugin = MixedPrecisionPlugin("bf16-mixed", policy=policy)
    plugin.connect(model, [], [])
    batch = {
        "input_ids": torch.randint(1000, 2000, (4, 32), generator=torch.Generator().manual_seed(0)),
        "attention_mask": torch.ones(4, 32, dtype=torch.long),
        "labels": torch.tensor([0, 1, 0, 1]),
    }
    try:
        return audit(model, batch, context=plugin.forward_context)
    finally:
        plugin.teardown()


LINEAR_OPS = {"addmm", "mm"}


def test_bert_default_policy_runs_linear_flops_in_half_and_the_loss_in_fp32():
    census = _bert_census()
    assert census.half_flops_fraction(ops=LINEAR_OPS) >= 0.99
    assert census.dtypes_of("_log_softmax") == {"float32"} and census.dtypes_of("nll_loss_forward") == {"float32"}
    # a finding the audit makes visible: on CPU, scaled_dot_product_attention's math path computes the
    # attention matmuls (bmm) and softmax in fp32 even under bf16 autocast
    assert census.dtypes_of("bmm", phase="forward") == {"float32"}
    assert census.dtypes_of("_safe_softmax") == {"float32"}
    assert census.dtypes_of("native_layer_norm") == {"float32"}  # its input is the fp32 residual sum


def test_bert_fp32_ops_linear_moves_the_linear_flops_to_fp32():
    census = _bert_census({"fp32_ops": ["linear"]})
    assert census.half_flops_fraction(ops=LINEAR_OPS) == 0.0


def test_bert_fp32_modules_classifier_moves_only_the_classifier():
    census = _bert_census({"fp32_modules": ["model.classifier"]})
    assert census.dtypes_of("addmm", module="model.classifier") == {"float32"}
    assert census.half_flops_fraction(ops=LINEAR_OPS, module="model.bert") == 1.0


def test_bert_module_declared_policy_is_what_runs():
    census = _bert_census(declared={"fp32_modules": ["model.bert.pooler"]})
    assert census.dtypes_of("addmm", module="model.bert.pooler") == {"float32"}
    assert census.dtypes_of("addmm", module="model.classifier") == {"bfloat16"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bert_default_policy_on_cuda_keeps_softmax_layer_norm_and_loss_fp32_and_matmuls_half():
    torch.manual_seed(0)
    model = BertClassifier(pretrained=False, config_overrides={**TINY_BERT, "attn_implementation": "eager"}).cuda()
    plugin = MixedPrecisionPlugin("16-mixed")
    plugin.connect(model, [], [])
    batch = {
        "input_ids": torch.randint(1000, 2000, (4, 32), device="cuda"),
        "attention_mask": torch.ones(4, 32, dtype=torch.long, device="cuda"),
        "labels": torch.tensor([0, 1, 0, 1], device="cuda"),
    }
    census = audit(model, batch, context=plugin.forward_context)
    assert census.half_flops_fraction() >= 0.99
    assert census.dtypes_of("_softmax", phase="forward") == {"float32"}
    assert "float16" not in "".join(census.dtypes_of("native_layer_norm"))
    assert census.dtypes_of("nll_loss_forward") == {"float32"}
