"""The diagnosis corpus (tests/corpus.py): HF GPT-2, Llama and BERT (padding mask; sdpa and eager attention),
nn.TransformerEncoder with a causal mask of -inf and of finfo.min, Lightning's demo Transformer and a CNN, each with
four planted faults, fit in fp16 with a PrecisionMonitor: every cell names the right cause, module, phase and op.
And the origin rule on hand-made cases: non-finite values made on purpose (masks, log(0)) that never reach the loss or
the gradients are no origin."""

import math

import pytest
import torch
from torch import nn

from lightning_mp.diagnostics import advise
from lightning_mp.diagnostics.nonfinite import NonFiniteTrace
from tests.corpus import EXPECTED, MODELS, PLANT_AT, PLANTS, run

pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # tensors of a few hundred values: thread start-up costs more than it saves (10x on a loaded 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CELLS = [(name, plant, False) for name in MODELS for plant in PLANTS]
# master weights: the model itself is fp16, and so are the HF models' finfo.min masks (they overflow to -inf when
# added to negative scores; the softmax heals them)
CELLS += [(name, plant, True) for name in ("gpt2", "bert_eager", "encoder_min") for plant in PLANTS]


@pytest.mark.parametrize("name, plant, masters", CELLS, ids=[f"{n}-{p}{'-masters' if m else ''}" for n, p, m in CELLS])
def test_every_corpus_cell_names_the_planted_cause_module_phase_and_op(name, plant, masters):
    model, monitor = run(name, plant, master_weights=masters)
    history = monitor.history
    cause, phase, op = EXPECTED[plant]
    rules = [advice.rule for advice in advise(history)]
    if plant == "init_scale":
        assert history.skipped == [0, 1, 2]  # 2**24, 2**23, 2**22: every scaled gradient overflows fp16
        assert [(r.cause, r.phase) for r in history.overflows] == [(cause, phase)] * 3
        assert "init_scale" in rules and "model" not in rules and "fp32_modules" not in rules
        return
    assert history.skipped == [PLANT_AT]  # step 0 ran clean: the masks alone never skip a step
    (record,) = history.overflows
    assert (record.cause, record.phase, record.module, record.op) == (cause, phase, model.target, op)
    if plant == "sqrt":
        (advice,) = [a for a in advise(history) if a.rule == "model"]
        assert model.target in advice.change
    else:
        assert "model" not in rules


def _softmax_attention(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (scores + mask).softmax(-1)


def test_a_finfo_min_mask_overflowing_to_minus_inf_in_fp16_is_no_origin_the_overflow_that_reaches_the_loss_is():
    scores = torch.randn(2, 4, 4).half()
    mask = torch.full((4, 4), torch.finfo(torch.float16).min).triu(1).half()
    head = nn.Linear(4, 4).half()
    with NonFiniteTrace(head, torch.device("cpu")) as trace:
        attention = _softmax_attention(scores - 1.0, mask)  # -65504 + negative score = -inf: born, then healed
        loss = (head(attention) * 1e5).float().sum()  # the real overflow, after the softmax
    origin = trace.origin([loss])
    assert (origin.op, origin.phase) == ("mul", "forward")
    assert trace.origin([attention.float().sum()]) is None  # the attention itself is finite: nothing to explain


def test_a_row_masked_everywhere_makes_nan_in_the_softmax_and_that_is_the_origin():
    scores = torch.randn(1, 3, 3)
    mask = torch.zeros(3, 3)
    mask[1] = -math.inf  # query 1 may attend nowhere
    with NonFiniteTrace(nn.Identity(), torch.device("cpu")) as trace:
        loss = _softmax_attention(scores, mask).sum()
    assert trace.origin([loss]).op == "_softmax"


def test_an_inf_planted_in_masked_scores_is_the_origin_not_the_minus_inf_mask_it_meets():
    scores = torch.randn(1, 3, 3) + 2.0
    mask = torch.full((3, 3), -math.inf).triu(1)
    with NonFiniteTrace(nn.Identity(), torch.device("cpu")) as trace:
        planted = scores.half() * 1e5  # inf everywhere, masked positions included: inf + -inf = NaN there
        loss = _softmax_attention(planted.float(), mask).sum()
    origin = trace.origin([loss])
    assert (origin.op, origin.input_amax) == ("mul", pytest.approx(float(scores.half().abs().max())))


def test_log_of_zero_that_never_reaches_the_loss_is_no_origin_but_its_nan_gradient_through_where_is():
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    with NonFiniteTrace(nn.Identity(), torch.device("cpu")) as trace:
        logs = torch.log(x)  # -inf at 0, on purpose: a log(0) bucket
        loss = torch.where(x > 0, logs, torch.zeros_like(x)).sum()
        assert trace.origin([loss]) is None  # the loss is finite: the -inf was by design
        trace.phase = "backward"
        (grad,) = torch.autograd.grad(loss, [x])
    assert torch.isnan(grad[0])  # the classic: d log(x) = 1/x = inf at 0, times where's zero gradient = NaN
    origin = trace.origin([grad])
    assert origin.phase == "backward"
