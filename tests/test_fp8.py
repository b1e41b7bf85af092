"""fp8 through the plugin (emulated on CPU): the argument, the layer choice, where it runs, training with the rest."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from lightning_mp import CastPolicy, MixedPrecisionPlugin
from lightning_mp.fp8.config import fp8_mode, linear_config
from tests.fp8_helpers import MLPModule, TinyLlama, mlp_loader, token_loader, trainer

pytest.importorskip("torchao")
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------- the argument
def test_fp8_none_never_imports_torchao():
    code = (
        "import sys, lightning_mp; lightning_mp.MixedPrecisionPlugin('bf16-mixed'); "
        "print(any(m.split('.')[0] == 'torchao' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("bad", ["fp8", "TENSORWISE", True, 8, {"recipe": "rowwise"}])
def test_a_bad_fp8_value_is_refused_naming_it_and_the_recipes(bad):
    with pytest.raises(ValueError, match="fp8") as error:
        MixedPrecisionPlugin("bf16-mixed", fp8=bad)
    assert repr(bad) in str(error.value) and "rowwise_with_gw_hp" in str(error.value)


def test_missing_torchao_is_an_error_naming_the_fp8_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=r"lightning_mp\[fp8\]"):
        MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")


def test_recipes_and_configs_are_accepted_and_shown_in_repr():
    from torchao.float8 import Float8LinearConfig

    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert f"fp8={recipe!r}" in repr(MixedPrecisionPlugin("bf16-mixed", fp8=recipe))
    config = Float8LinearConfig(round_scales_to_power_of_2=True)
    plugin = MixedPrecisionPlugin("16-mixed", fp8=config)
    assert plugin.fp8.spec is config and "fp8='custom'" in repr(plugin)


# ---------------------------------------------------------------------- where it runs
def test_cpu_emulates_and_keeps_the_users_config_otherwise():
    from torchao.float8 import Float8LinearConfig

    config, notes = linear_config("rowwise", torch.device("cpu"))
    assert config.emulate and config.round_scales_to_power_of_2 and "emulated" in notes[0]
    custom, _ = linear_config(Float8LinearConfig(pad_inner_dim=True), torch.device("cpu"))
    assert custom.emulate and custom.pad_inner_dim
    fsdp, notes = linear_config("tensorwise", torch.device("cpu"), fsdp2=True)
    assert fsdp.enable_fsdp_float8_all_gather and "all-gathers" in notes[-1]
    rowwise, notes = linear_config("rowwise", torch.device("cpu"), fsdp2=True)
    assert not rowwise.enable_fsdp_float8_all_gather and "high precision" in notes[-1]


def test_a_cuda_device_without_fp8_is_refused_naming_its_capability(monkeypatch):
    # the decision alone (no GPU here): an A100 reports compute capability 8.0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"A100 of compute capability 8\.0"):
        fp8_mode(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8_mode(torch.device("cuda", 0)) == "real"


@pytest.mark.gpu
@gpu
def test_real_fp8_on_a_gpu_with_fp8_trains_without_emulation():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    model, plugin = MLPModule(), MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")
    trainer(plugin, 5, accelerator="gpu").fit(model, mlp_loader())
    assert plugin.fp8.mode == "real" and not plugin.fp8.config.emulate


@pytest.mark.gpu
@gpu
def test_real_fp8_on_a_gpu_evaluates_after_training():
    """trainer.test after fit with real fp8 (an H100 run of compare.py's decoder-4096 trained, then failed here:
    autocast's cast of an fp8 operand, aten.to.dtype on a Float8TrainingTensor): evaluation runs and returns the
    same logits as the training-mode forward of the same weights under the plugin's context."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability >= 8.9")
    model, plugin = MLPModule(), MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")
    run = trainer(plugin, 3, accelerator="gpu")
    run.fit(model, mlp_loader())
    batch = next(iter(mlp_loader()))[0].cuda()
    with torch.no_grad(), plugin.forward_context():
        trained = model(batch)
    with torch.inference_mode(), plugin.forward_context():
        evaluated = model(batch)
    torch.testing.assert_close(evaluated, trained, rtol=0, atol=0)


# ---------------------------------------------------------------------- which layers
def test_policy_fp8_rules_come_from_yaml_are_validated_merged_and_described():
    policy = CastPolicy.coerce({"fp8_exclude": ["keep", "LayerNorm"], "fp8_only": []})
    assert policy.fp8_exclude == ("keep", "LayerNorm")
    assert "'keep'" in policy.describe() and "fp8_exclude" in policy.describe()
    merged = policy.merged_with(CastPolicy(fp8_only=("up",)))
    assert merged.fp8_exclude == ("keep", "LayerNorm") and merged.fp8_only == ("up",)
    with pytest.raises(ValueError, match="fp8_exclude"):
        CastPolicy(fp8_exclude="keep")
    with pytest.raises(ValueError, match="fp8_only"):
        CastPolicy(fp8_only=[""])
    with pytest.raises(ValueError, match="fp8_include"):
        CastPolicy.coerce({"fp8_include": ["x"]})


def test_the_setup_table_gives_every_linear_layer_its_decision_and_reason(caplog):
    model = MLPModule(mixed=True)
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise", policy={"fp8_exclude": ["net.keep"]})
    with caplog.at_level("INFO"):
        trainer(plugin, 2).fit(model, mlp_loader())
    reasons = {layer.name: (layer.converted, layer.reason) for layer in plugin.fp8.layers}
    assert reasons["net.up"] == (True, "")
    assert "not multiples of 16" in reasons["net.odd"][1]
    assert "subclass of nn.Linear" in reasons["net.attn.out_proj"][1]
    assert reasons["net.keep"] == (False, "fp8_exclude rule 'net.keep'")
    assert "output projection" in reasons["net.head"][1]
    from torchao.float8.float8_linear import Float8Linear

    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == ["net.up"]
    assert "1 of 5 nn.Linear layers" in caplog.text and "fp8_exclude rule 'net.keep'" in caplog.text


def test_fp32_modules_are_never_fp8_and_fp8_only_can_name_the_output_projection():
    plugin = MixedPrecisionPlugin(
        "bf16-mixed", fp8="tensorwise", policy={"fp32_modules": ["net.2"], "fp8_only": ["net.2", "net.4"]}
    )
    trainer(plugin, 1).fit(MLPModule(), mlp_loader())
    reasons = {layer.name: (layer.converted, layer.reason) for layer in plugin.fp8.layers}
    assert reasons["net.0"] == (False, "not named by fp8_only")
    assert reasons["net.2"][0] is False and "fp32" in reasons["net.2"][1]
    assert reasons["net.4"] == (True, "")  # the output projection, named


def test_no_eligible_layer_warns_naming_fp8():
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="rowwise", policy={"fp8_exclude": ["Linear"]})
    with pytest.warns(UserWarning, match=r"fp8='rowwise'\): no nn.Linear layer of MLPModule is eligible"):
        trainer(plugin, 1).fit(MLPModule(), mlp_loader())
    assert plugin.fp8.converted == []


def test_an_fp8_rule_that_matches_nothing_warns_with_the_closest_names():
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise", policy={"fp8_exclude": ["net.9"]})
    with pytest.warns(UserWarning, match=r"fp8_exclude rule 'net.9' matches no module"):
        trainer(plugin, 1).fit(MLPModule(), mlp_loader())


# ---------------------------------------------------------------------- training
def _final(losses: list[float], last: int = 6) -> float:
    return sum(losses[-last:]) / last


@pytest.mark.parametrize("masters", [False, True], ids=["no-masters", "masters"])
def test_emulated_fp8_trains_an_hf_llama_within_5_percent_of_bf16(masters):
    pytest.importorskip("transformers")
    losses = {}
    for fp8 in (None, "tensorwise"):
        model = TinyLlama(lr=1e-2, hidden=32, layers=1)
        plugin = MixedPrecisionPlugin("bf16-mixed", fp8=fp8, master_weights=masters)
        trainer(plugin, 24).fit(model, token_loader(64, 8))
        losses[fp8] = model.losses
    assert _final(losses[None]) < 0.6 * losses[None][0]  # bf16 learned
    assert abs(_final(losses["tensorwise"]) - _final(losses[None])) <= 0.05 * _final(losses[None])
    assert losses["tensorwise"] != losses[None]  # fp8 did run: the losses differ in their rounding


def test_fp8_with_16_mixed_trains_with_the_loss_scaler():
    model = MLPModule()
    plugin = MixedPrecisionPlugin("16-mixed", fp8="tensorwise", scaler={"init_scale": 2.0**16})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU is slow: it says so
        trainer(plugin, 8).fit(model, mlp_loader())
    assert plugin.scaler.skipped_steps == 0 and plugin.fp8.converted == ["net.0", "net.2"]
    x, y = next(iter(mlp_loader()))
    with torch.no_grad():
        assert nn.functional.cross_entropy(model(x), y) < 2.5  # from ln(16) = 2.77 at the start


def test_checkpoint_state_dict_is_plain_fp32_and_loads_strictly_into_an_unconverted_model(tmp_path):
    model = MLPModule()
    trainer(
        MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise", master_weights=True), 3, default_root_dir=tmp_path
    ).fit(model, mlp_loader())
    path = tmp_path / "fp8.ckpt"
    model.trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=True)["state_dict"]
    assert all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values())
    fresh = MLPModule()
    fresh.load_state_dict(state, strict=True)
    assert all(type(m) in (nn.Linear, nn.GELU, nn.Sequential) for m in fresh.net.modules())
    assert torch.equal(fresh.net[0].weight, model.net[0].weight.detach())


@pytest.mark.parametrize("masters", [False, True, "remainder"], ids=["no-masters", "masters", "remainder"])
def test_resumed_fp8_run_continues_bit_exactly(tmp_path, masters):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(ckpt: object = None, save: bool = False) -> dict[str, torch.Tensor]:
        model = MLPModule()
        callbacks = (
            [
                ModelCheckpoint(
                    dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=True
                )
            ]
            if save
            else []
        )
        plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise", master_weights=masters)
        trainer(plugin, -1, max_epochs=2, callbacks=callbacks, enable_checkpointing=save).fit(
            model, mlp_loader(), ckpt_path=ckpt
        )
        assert plugin.fp8.converted == ["net.0", "net.2"]
        return {name: p.detach().clone() for name, p in model.named_parameters()}

    full = run(save=True)
    resumed = run(ckpt=tmp_path / "epoch=0.ckpt")
    assert all(torch.equal(full[name], resumed[name]) for name in full)


def test_a_compiled_fp8_model_trains():
    model = MLPModule(lr=3e-2)
    model.net = torch.compile(model.net)
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")
    x, y = next(iter(mlp_loader()))
    with torch.no_grad():
        before = float(nn.functional.cross_entropy(model(x).float(), y))
    trainer(plugin, 6).fit(model, mlp_loader())
    assert plugin.fp8.converted == ["net._orig_mod.0", "net._orig_mod.2"]
    with torch.no_grad():
        assert float(nn.functional.cross_entropy(model(x).float(), y)) < before


# ---------------------------------------------------------------------- the audit's census
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise_with_gw_hp"])
def test_the_census_counts_the_matmuls_that_dispatch_with_fp8_operands(recipe):
    # What dispatches (seen here with a TorchDispatchMode, torch 2.13 + torchao 0.18): every Float8Linear matmul is
    # one aten.mm whose operands are Float8TrainingTensor subclasses holding float8_e4m3fn / float8_e5m2 data (the
    # emulated fp32 product, or CUDA's _scaled_mm, runs inside the subclass, below the mode); the casts are
    # _to_copy to float8. Per 16-row batch, net.0 (32x64) and net.2 (64x32) make 2*16*2048 FLOPs a matmul, the
    # bf16 output layer net.4 (32x16) 2*16*512; backward computes both gradients of every layer (torchao computes
    # the input gradient of net.0 too). rowwise_with_gw_hp keeps the weight gradients in bf16.
    from lightning_mp import audit

    model = MLPModule()
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8=recipe)
    trainer(plugin, 1).fit(model, mlp_loader())
    x, y = next(iter(mlp_loader()))
    census = audit(model, lambda: nn.functional.cross_entropy(model(x).float(), y), context=plugin.forward_context)
    big, small = 2 * 16 * 2048, 2 * 16 * 512
    assert census.fp8_flops_fraction(phase="forward") == pytest.approx(2 * big / (2 * big + small))
    fp8_backward = 4 * big if recipe == "tensorwise" else 2 * big
    assert census.fp8_flops_fraction(phase="backward") == pytest.approx(fp8_backward / (4 * big + 2 * small))
    assert census.dtypes_of("mm", phase="forward", module="net.0") == {"float8_e4m3fn"}
    assert "float8_e4m3fn+float8_e5m2" in census.dtypes_of("mm", phase="backward") or recipe != "tensorwise"
    assert census.dtypes_of("addmm", phase="forward", module="net.4") == {"bfloat16"}
    assert "in fp8:" in census.summary() and census.to_dict()["fp8_flops_fraction"] > 0.5


def test_an_fp8_model_evaluates_under_inference_mode_on_cpu():
    # CPU autocast would cast the fp8 operands inside Float8Linear (aten.to.dtype, unsupported under inference mode):
    # the plugin runs converted layers as CUDA autocast runs them (input cast, autocast off inside)
    model = MLPModule()
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")
    fit = trainer(plugin, 2)
    fit.fit(model, mlp_loader())
    x, _ = next(iter(mlp_loader()))
    with torch.inference_mode(), plugin.forward_context():
        out = model(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    fit.validate(model, mlp_loader(), verbose=False)  # Lightning's evaluation runs under inference mode
