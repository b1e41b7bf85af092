"""A real client: LitGPT's own ``GPT`` (litgpt 0.5.13, installed with ``--no-deps``: see README's set-up) trained in
a Fabric loop with lean masters and torchao's ``AdamW8bit``, against ``bf16-true`` and ``bf16-mixed``, through the
functions of examples/litgpt_finetune.py (the benchmark benchmarks/fabric_litgpt.py runs them at a larger size)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import litgpt_finetune as example

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_litgpt_and_transformers_import_together():
    """litgpt installed without its dependencies leaves transformers importable (its pins would break it)."""
    import litgpt
    import transformers
    from transformers import LlamaConfig

    assert litgpt.Config and LlamaConfig and transformers.__version__


@pytest.fixture(scope="module")
def finetuned() -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = example.pretrained("tiny", 10)
        runs = {"before": example.held_out_loss(weights, "tiny")}
        for mode in ("bf16-true", "bf16-mixed", "ours+remainder+8bit", "ours+remainder", "ours+remainder+inbackward"):
            result = example.finetune(mode, weights, "tiny", 10)
            runs[mode] = example.held_out_loss(result["trained"], "tiny")
            runs[mode, "trained"] = result["trained"]
    return runs


def test_lean_masters_with_adamw8bit_fine_tune_as_bf16_mixed_and_better_than_bf16_true(finetuned):
    """lr 2e-5: bf16-true loses most updates (below half a bf16 spacing); lean masters keep them."""
    assert finetuned["bf16-mixed"] < finetuned["before"]
    assert finetuned["ours+remainder+8bit"] == pytest.approx(finetuned["bf16-mixed"], rel=0.005)
    assert finetuned["ours+remainder+8bit"] < finetuned["bf16-true"]


def test_lean_masters_with_adamw8bit_hold_at_most_8_6_bytes_per_parameter_at_rest():
    """bf16 weight 2 + remainder 2 + bf16 gradient 2 + two 8-bit moments ~2, on the "small" model (8.7M parameters,
    where the lean step's fixed staging buffers are negligible); two steps, gradients still held."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from litgpt.model import GPT

        torch.manual_seed(0)
        weights = GPT(example.config("small")).state_dict()
        result = example.finetune("ours+remainder+8bit", weights, "small", 2)
    assert result["bytes_per_param"] <= 8.6


def test_the_step_inside_backward_fine_tunes_bit_for_bit_as_the_normal_lean_step(finetuned):
    """The same LitGPT model and Fabric loop (``fabric.backward`` then ``optimizer.step``): the same trained values."""
    ours, normal = finetuned["ours+remainder+inbackward", "trained"], finetuned["ours+remainder", "trained"]
    assert ours.keys() == normal.keys() and all(torch.equal(ours[k], v) for k, v in normal.items())
    assert finetuned["ours+remainder+inbackward"] < finetuned["bf16-true"]


def test_adamw8bit_inside_backward_holds_at_most_6_6_bytes_per_parameter_at_rest():
    """bf16 weight 2 + remainder 2 + two 8-bit moments ~2 and no gradient (freed inside backward), on the "small"
    model; two steps. The normal lean step with AdamW8bit holds 2 more (its bf16 gradients, test above)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from litgpt.model import GPT

        torch.manual_seed(0)
        weights = GPT(example.config("small")).state_dict()
        result = example.finetune("ours+remainder+8bit+inbackward", weights, "small", 2)
    assert result["bytes_per_param"] <= 6.6
