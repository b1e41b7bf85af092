"""audit(): dtypes, phases, modules and matmul FLOPs of what actually ran, checked against hand-computed values."""

import json
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from lightning_mp.diagnostics import Census, audit


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _flops(census: Census, **filters) -> int:
    return sum(r.flops for r in census.select(**filters))


def _calls(census: Census, **filters) -> int:
    return sum(r.count for r in census.select(**filters))


def _assert_no_hooks(module: nn.Module) -> None:
    for name, sub in module.named_modules():
        assert not sub._forward_hooks and not sub._forward_pre_hooks, name
        assert not sub._forward_hooks_always_called, name


# ------------------------------------------------------------------------------------------------ Linear / FLOPs


def test_linear_under_bf16_autocast_runs_addmm_in_bfloat16_with_2mkn_flops():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    census = audit(layer, torch.randn(3, 8), context=_bf16(), backward=False)
    assert census.dtypes_of("addmm") == {"bfloat16"}
    assert _flops(census, op="addmm") == 2 * 3 * 8 * 4  # m=3 rows, k=8 inputs, n=4 outputs
    assert census.half_flops_fraction() == 1.0
    assert census.dtypes_of("_to_copy") == {"float32"}  # autocast's casts of x, weight, bias are recorded
    assert _calls(census, op="_to_copy") == 3
    assert {r.phase for r in census.rows} == {"forward"}


def test_linear_without_autocast_is_float32_and_half_fraction_is_zero():
    census = audit(nn.Linear(8, 4), torch.randn(3, 8), backward=False)
    assert census.dtypes_of("addmm") == {"float32"}
    assert _flops(census, op="addmm") == 192
    assert census.half_flops_fraction() == 0.0


def test_backward_records_grad_input_and_grad_weight_matmuls_with_their_flops():
    layer = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    census = audit(layer, x, context=_bf16())
    # grad_input = grad_out (3,4) @ W (4,8): 2*3*4*8; grad_weight = grad_out^T (4,3) @ x (3,8): 2*4*3*8
    assert _flops(census, op="mm", phase="backward") == 2 * 3 * 4 * 8 + 2 * 4 * 3 * 8
    assert _calls(census, op="mm", phase="backward") == 2
    assert census.dtypes_of("mm", phase="backward") == {"bfloat16"}
    assert census.dtypes_of("sum", phase="backward") == {"bfloat16"}  # the bias gradient, reduced over the batch
    assert census.half_flops_fraction(phase="backward") == 1.0
    assert layer.weight.grad is None and layer.bias.grad is None  # the parameters' gradients as they were
    assert x.grad is not None  # an input of the caller's own gets its gradient, as from backward


def test_sequential_ops_are_attributed_to_the_innermost_submodule_in_both_phases():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    census = audit(model, torch.randn(3, 8))
    assert {r.module for r in census.select(op="addmm")} == {"0", "2"}
    assert _flops(census, op="addmm", module="0") == 2 * 3 * 8 * 4
    assert _flops(census, op="addmm", module="2") == 2 * 3 * 4 * 2
    assert census.select(op="relu")[0].module == "1"
    # backward: layer 2 computes grad_input and grad_weight (2*3*2*4 each), layer 0 only grad_weight (x needs none)
    assert _flops(census, op="mm", phase="backward", module="2") == 2 * (2 * 3 * 2 * 4)
    assert _flops(census, op="mm", phase="backward", module="0") == 2 * 4 * 3 * 8
    assert census.select(op="threshold_backward")[0].module == "1"


def test_half_flops_fraction_is_restricted_by_module_prefix_and_ops():
    class Fp32Head(nn.Linear):
        def forward(self, x):
            with torch.autocast("cpu", enabled=False):
                return super().forward(x.float())

    model = nn.Sequential(nn.Linear(8, 4), Fp32Head(4, 2))
    census = audit(model, torch.randn(3, 8), context=_bf16(), backward=False)
    assert census.dtypes_of("addmm", module="1") == {"float32"}
    assert census.half_flops_fraction() == pytest.approx(192 / (192 + 48))
    assert census.half_flops_fraction(module="0") == 1.0
    assert census.half_flops_fraction(module="1") == 0.0
    assert census.half_flops_fraction(ops=["addmm"]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="no matmul FLOPs recorded for ops='mm'"):
        census.half_flops_fraction(ops="mm")


# ------------------------------------------------------------------------------------------------ conv / attention


@pytest.mark.parametrize(
    ("in_ch", "out_ch", "groups", "expected"),
    [
        (2, 3, 1, 2 * (1 * 3 * 3 * 3) * 2 * 9),  # 2 * out_numel * in_ch/groups * 3x3
        (4, 4, 2, 2 * (1 * 4 * 3 * 3) * 2 * 9),
    ],
)
def test_conv2d_flops_are_two_times_out_numel_times_in_per_group_times_kernel(in_ch, out_ch, groups, expected):
    conv = nn.Conv2d(in_ch, out_ch, 3, groups=groups)
    x = torch.randn(1, in_ch, 5, 5, requires_grad=True)
    census = audit(conv, x)
    assert _flops(census, op="convolution", phase="forward") == expected
    # convolution_backward computes grad_input and grad_weight: one forward-sized conv each
    assert _flops(census, op="convolution_backward", phase="backward") == 2 * expected


def test_sdpa_on_cpu_runs_the_flash_kernel_with_4bhsqskd_forward_and_twice_that_backward_flops():
    q = torch.randn(1, 2, 3, 4, requires_grad=True)
    k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    census = audit(nn.Identity(), lambda: F.scaled_dot_product_attention(q, k, v))
    forward = 4 * 1 * 2 * 3 * 5 * 4  # Q@K^T and P@V: 2 matmuls of 2*b*h*s_q*s_k*d
    assert {r.op for r in census.rows if r.flops} == {
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
    }
    assert _flops(census, phase="forward") == forward
    assert _flops(census, phase="backward") == 2 * forward


# ------------------------------------------------------------------------------------------------------- risky ops


def test_mse_loss_and_log_softmax_in_bf16_are_flagged_but_not_in_fp32():
    def losses(dtype):
        a, b = torch.randn(4, 5, dtype=dtype), torch.randn(4, 5, dtype=dtype)
        return lambda: F.mse_loss(a, b) + F.log_softmax(a, dim=-1).sum() * 0

    risky = audit(nn.Identity(), losses(torch.bfloat16), backward=False).risky
    assert {(f.op, f.dtype) for f in risky} == {("mse_loss", "bfloat16"), ("_log_softmax", "bfloat16")}
    assert all(f.why and f.module == "" and f.phase == "forward" for f in risky)
    assert audit(nn.Identity(), losses(torch.float32), backward=False).risky == []


def test_fused_half_to_float_softmax_is_reported_in_float32_and_not_flagged():
    # CUDA autocast's softmax/log_softmax on fp16 runs _softmax(x_fp16, dim, half_to_float=True): fp32 compute and
    # output with no cast first. The CPU kernel lacks that path; meta tensors take it, so the test runs anywhere.
    x = torch.randn(4, 8, dtype=torch.float16, device="meta")

    def fused():
        return torch.ops.aten._softmax(x, -1, True), torch.ops.aten._log_softmax(x, -1, True)

    census = audit(nn.Identity(), fused, backward=False)
    assert census.dtypes_of("_softmax") == {"float32"} and census.dtypes_of("_log_softmax") == {"float32"}
    assert census.risky == []
    plain = audit(nn.Identity(), lambda: torch.ops.aten._log_softmax(x, -1, False), backward=False)
    assert plain.dtypes_of("_log_softmax") == {"float16"} and [f.op for f in plain.risky] == ["_log_softmax"]


def test_bf16_sum_over_large_reduction_elements_is_flagged_and_a_small_one_is_not():
    big, small = torch.ones(65536, dtype=torch.bfloat16), torch.ones(65535, dtype=torch.bfloat16)
    assert [f.op for f in audit(nn.Identity(), lambda: big.sum(), backward=False).risky] == ["sum"]
    assert audit(nn.Identity(), lambda: small.sum(), backward=False).risky == []
    assert audit(nn.Identity(), lambda: big.float().sum(), backward=False).risky == []


def test_large_reduction_counts_elements_per_output_value():
    x = torch.ones(4, 8, dtype=torch.bfloat16)
    assert len(audit(nn.Identity(), lambda: x.sum(dim=1), backward=False, large_reduction=8).risky) == 1
    assert audit(nn.Identity(), lambda: x.sum(dim=0), backward=False, large_reduction=8).risky == []  # 4 each


def test_zero_dim_float32_operand_does_not_hide_a_bf16_op():
    x = torch.ones(3, dtype=torch.bfloat16)
    census = audit(nn.Identity(), lambda: (x * torch.tensor(2.0), torch.arange(3)), backward=False)
    assert census.dtypes_of("mul") == {"bfloat16"}
    assert census.dtypes_of("arange") == {"-"}


# ---------------------------------------------------------------------------------------------- entry points


class _LoggingModule(L.LightningModule):
    def __init__(self, as_dict: bool = False):
        super().__init__()
        self.layer = nn.Linear(8, 4)
        self.as_dict = as_dict

    def training_step(self, batch, batch_idx):
        loss = F.mse_loss(self.layer(batch), torch.zeros(3, 4))
        self.log("train_loss", loss)
        return {"loss": loss} if self.as_dict else loss


@pytest.mark.parametrize("as_dict", [False, True])
def test_lightning_module_runs_training_step_without_a_trainer_and_silences_log(as_dict):
    model = _LoggingModule(as_dict)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        census = audit(model, torch.randn(3, 8), context=_bf16())
    assert not [w for w in caught if "self.log" in str(w.message)]
    assert "log" not in model.__dict__  # the no-op patch is gone again
    assert census.dtypes_of("addmm", module="layer") == {"bfloat16"}
    assert census.dtypes_of("mse_loss") == {"float32"}  # CPU autocast keeps mse_loss in float32
    assert census.select(op="mse_loss")[0].module == ""  # the loss runs in training_step, outside any submodule
    assert all(p.grad is None for p in model.parameters())  # the audit's backward left no gradient behind
    _assert_no_hooks(model)


def test_tuple_and_dict_batches_are_unpacked_into_forward():
    class Add(nn.Module):
        def forward(self, a, b):
            return a + b

    for batch in ((torch.ones(2), torch.ones(2)), {"a": torch.ones(2), "b": torch.ones(2)}):
        assert _calls(audit(Add(), batch, backward=False), op="add") == 1


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_forward_under_no_grad_or_inference_mode_with_backward_false(mode):
    layer = nn.Linear(8, 4)
    census = audit(layer, torch.randn(3, 8), context=mode(), backward=False)
    # inference mode hides autograd, so composite ops reach the recorder undecomposed: "linear" instead of "addmm"
    ops = census.select(phase="forward")
    assert sum(r.flops for r in ops) == 2 * 3 * 8 * 4
    assert {r.op for r in ops if r.flops} <= {"addmm", "linear"}
    with mode():
        assert _flops(audit(layer, torch.randn(3, 8), backward=False)) == 192


def test_inference_mode_counts_undecomposed_sdpa_and_conv2d():
    q, conv = torch.randn(1, 2, 3, 4), nn.Conv2d(2, 3, 3)
    with torch.inference_mode():
        census = audit(
            conv, lambda: (F.scaled_dot_product_attention(q, q, q), conv(torch.randn(1, 2, 5, 5))), backward=False
        )
    assert _flops(census, op="scaled_dot_product_attention") == 4 * 1 * 2 * 3 * 3 * 4
    assert _flops(census, op="conv2d") == 2 * 27 * 2 * 9


def test_backward_true_with_a_loss_that_needs_no_grad_raises_and_cleans_up():
    layer = nn.Linear(8, 4)
    with pytest.raises(ValueError, match="does not require grad"):
        audit(layer, torch.randn(3, 8), context=torch.inference_mode())
    _assert_no_hooks(layer)


# --------------------------------------------------------------------------------------------- report / cleanup


def test_table_has_header_ops_summary_and_findings_and_to_dict_is_json():
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    x = torch.randn(3, 8)
    census = audit(model, lambda: F.mse_loss(model(x), torch.zeros(3, 4)), context=_bf16())
    text = str(census)
    assert text.splitlines()[0].split() == ["op", "phase", "dtype", "calls", "GFLOPs", "module"]
    assert "addmm" in text and "relu" in text
    assert "matmul FLOPs in half precision: 100.0%" in text
    assert text == census.table()
    data = json.loads(json.dumps(census.to_dict()))
    assert data["half_flops_fraction"] == 1.0
    assert {"op", "dtype", "phase", "module", "count", "flops"} <= set(data["rows"][0])
    assert data["rows"][0]["op"] == census.rows[0].op


def test_table_lists_risky_findings_and_rows_sorted_by_flops():
    x = torch.ones(65536, dtype=torch.bfloat16)
    layer = nn.Linear(8, 4)
    census = audit(layer, lambda: (layer(torch.randn(3, 8)), x.sum()), backward=False)
    lines = census.table().splitlines()
    assert lines[2].split()[0] == "addmm"  # the only row with FLOPs comes first
    assert "risky ops (1):" in lines
    assert any(line.strip().startswith("sum [bfloat16, forward]") for line in lines)


def test_hooks_and_modes_are_removed_after_success_and_after_a_raising_forward():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(8, 4), Boom())
    with pytest.raises(RuntimeError, match="boom"):
        audit(model, torch.randn(3, 8))
    _assert_no_hooks(model)
    assert _get_current_dispatch_mode() is None

    audit(model[0], torch.randn(3, 8))
    _assert_no_hooks(model)
    assert _get_current_dispatch_mode() is None


def test_bad_arguments_name_the_value_and_what_is_allowed():
    with pytest.raises(ValueError, match="large_reduction must be a positive int.*got 0"):
        audit(nn.Identity(), lambda: torch.ones(1), large_reduction=0)
    with pytest.raises(TypeError, match="context must be None, a context manager.*got 3"):
        audit(nn.Identity(), lambda: torch.ones(1), context=3)


def test_audit_leaves_existing_gradients_unchanged_and_none_as_none():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    model(torch.randn(3, 8)).sum().backward()
    model[1].bias.grad = None  # some gradients set (the first layer's, the second's weight), one None
    before = {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}
    kept = model[0].weight.grad
    audit(model, torch.randn(3, 8))
    for name, param in model.named_parameters():
        assert (param.grad is None) == (before[name] is None), name
        if param.grad is not None:
            assert torch.equal(param.grad, before[name]), name
    assert model[0].weight.grad is kept  # the same tensor, not a copy
