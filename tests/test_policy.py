"""CastPolicy: validation, presets, describe(), and every field changing what runs in which dtype."""

from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mp import CastPolicy, MixedPrecisionPlugin
from lightning_mp.policy import OPS, PRESETS
from tests.helpers import make_trainer, regression_loader, seeded


class OpDtypes(TorchDispatchMode):
    """aten op name -> set of dtypes its floating inputs had (a small stand-in for lightning_mp.audit)."""

    def __init__(self):
        super().__init__()
        self.seen = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        self.seen.setdefault(func.overloadpacket.__name__, set()).update(dtypes)
        return func(*args, **(kwargs or {}))


class Head(nn.Module):
    """linear -> layer_norm -> softmax attention-like mix -> classifier -> cross_entropy."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.classifier = nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.norm(self.proj(x))
        h = torch.softmax(h, dim=-1) * h
        return nn.functional.cross_entropy(self.classifier(h), y)


def _run(policy, precision="bf16-mixed"):
    torch.manual_seed(0)
    model = Head()
    plugin = MixedPrecisionPlugin(precision, policy=policy)
    plugin.connect(model, [], [])
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    with OpDtypes() as record, plugin.forward_context():
        loss = model(x, y)
    loss.backward()
    plugin.teardown()
    return record.seen


BF16, FP32 = torch.bfloat16, torch.float32


# ---------------------------------------------------------------------- plain data
def test_unknown_op_names_close_matches():
    with pytest.raises(ValueError, match=r"unknown op 'softmx'.*Did you mean \['softmax'"):
        CastPolicy(fp32_ops=["softmx"])


def test_same_op_in_both_lists_is_refused():
    with pytest.raises(ValueError, match=r"\['softmax'\] are in both"):
        CastPolicy(low_precision_ops=["softmax"], fp32_ops=["softmax", "sum"])


@pytest.mark.parametrize(
    "bad, fragment",
    [(dict(preset="fastest"), "preset='fastest'"), (dict(fp32_ops="softmax"), "fp32_ops='softmax' must be a list")],
)
def test_bad_fields_name_the_value(bad, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        CastPolicy(**bad)


def test_policy_is_frozen_comparable_and_coerced_from_name_or_mapping():
    policy = CastPolicy(preset="conservative", fp32_ops=["linear"], fp32_modules=["classifier"])
    assert policy == CastPolicy.coerce(
        {"preset": "conservative", "fp32_ops": ["linear"], "fp32_modules": ["classifier"]}
    )
    assert CastPolicy.coerce("fast") == CastPolicy(preset="fast") and CastPolicy.coerce(None) == CastPolicy()
    with pytest.raises(AttributeError):
        policy.preset = "fast"
    with pytest.raises(ValueError, match=r"\['fp32_op'\] are not CastPolicy fields"):
        CastPolicy.coerce({"fp32_op": ["linear"]})


def test_describe_shows_every_op_with_its_decision_and_source():
    policy = CastPolicy(preset="conservative", low_precision_ops=["cross_entropy"], fp32_modules=["classifier"])
    cpu, cuda = policy.describe("cpu", modules=Head()), CastPolicy().describe("cuda")
    for op in OPS:
        assert f"\n{op} " in cpu
    assert "softmax                            fp32     preset conservative" in cpu
    assert "cross_entropy                      half     user" in cpu
    assert "linear                             half     autocast default (cpu)" in cpu
    assert "softmax                            fp32     autocast default (cuda)" in cuda
    assert "module 'classifier'" in cpu and "-> 1 modules: classifier" in cpu


# ---------------------------------------------------------------------- every field moves the dtypes
def test_default_policy_is_autocast_alone():
    seen = _run(None)
    assert seen["addmm"] == {BF16}
    assert seen["_softmax"] == {BF16}  # CPU autocast leaves softmax to its (bf16) inputs
    assert FP32 in seen["_log_softmax"]  # the loss runs in fp32


def test_fp32_ops_move_ops_up():
    seen = _run({"fp32_ops": ["softmax", "linear"]})
    assert seen["_softmax"] == {FP32} and seen["addmm"] == {FP32}


def test_low_precision_ops_move_ops_down():
    seen = _run({"low_precision_ops": ["cross_entropy"]})
    assert seen["_log_softmax"] == {BF16}


def test_fp32_modules_by_name_and_by_class():
    by_name = _run({"fp32_modules": ["classifier"]})
    by_class = _run({"fp32_modules": ["LayerNorm"]})
    assert by_name["addmm"] == {BF16, FP32}  # proj in bf16, classifier in fp32
    assert by_class["native_layer_norm"] == {FP32}


def test_conservative_preset_reproduces_cuda_choices_on_cpu():
    seen = _run("conservative")
    assert seen["_softmax"] == {FP32} and seen["native_layer_norm"] == {FP32} and seen["addmm"] == {BF16}


def test_fast_preset_runs_norms_and_softmax_in_half_and_losses_in_fp32():
    seen = _run("fast")
    assert seen["native_layer_norm"] == {BF16} and seen["_softmax"] == {BF16}
    assert FP32 in seen["_log_softmax"] and BF16 not in seen["_log_softmax"]


def test_presets_are_all_valid_policies():
    for name in PRESETS:
        assert CastPolicy(preset=name).preset == name


# ---------------------------------------------------------------------- inside Lightning
class PolicyRegressor(L.LightningModule):
    def __init__(self, declared=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.declared = declared
        self.val_dtypes = set()

    def configure_precision_policy(self):
        return self.declared

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        with OpDtypes() as record:
            self.net(x)
        self.val_dtypes |= record.seen.get("addmm", set()) | record.seen.get(
            "linear", set()
        )  # linear under inference_mode

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_module_declaration_is_merged_and_wins():
    plugin = MixedPrecisionPlugin("bf16-mixed", policy={"low_precision_ops": ["linear"], "fp32_ops": ["sum"]})
    with seeded():
        model = PolicyRegressor(declared={"fp32_ops": ["linear"]})
    make_trainer(plugin, max_steps=1).fit(model, regression_loader())
    assert plugin.effective_policy.fp32_ops == ("sum", "linear")
    assert plugin.effective_policy.low_precision_ops == ()
    # printed for the device the run used (CPU here), whatever the machine has
    printed = str(plugin.effective_policy)
    assert printed.startswith("CastPolicy(preset='autocast') on cpu\n") and "autocast default (cpu)" in printed
    assert "(cuda)" not in printed
    assert plugin.effective_policy == plugin.policy.merged_with(CastPolicy(fp32_ops=["linear"]))  # a copy, equal


def test_validation_under_no_grad_applies_the_policy():
    plugin = MixedPrecisionPlugin("bf16-mixed", policy={"fp32_modules": ["net.2"]})
    with seeded():
        model = PolicyRegressor()
    make_trainer(plugin).validate(model, regression_loader())
    assert model.val_dtypes == {BF16, FP32}


def test_subclass_decides_per_module():
    class LastLayerFp32(MixedPrecisionPlugin):
        def keeps_fp32(self, name, module):
            return name == "net.2"

    plugin = LastLayerFp32("bf16-mixed")
    with seeded():
        model = PolicyRegressor()
    make_trainer(plugin).validate(model, regression_loader())
    assert model.val_dtypes == {BF16, FP32}


def test_master_weights_keep_fp32_modules_params_fp32_and_out_of_the_masters():
    class Probe(PolicyRegressor):
        def on_train_batch_end(self, *args):
            self.dtypes = {n: p.dtype for n, p in self.named_parameters()}

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=True, policy={"fp32_modules": ["net.2"]})
    with seeded():
        model = Probe()
    make_trainer(plugin, max_steps=1).fit(model, regression_loader())
    assert model.dtypes == {"net.0.weight": BF16, "net.0.bias": BF16, "net.2.weight": FP32, "net.2.bias": FP32}


def test_policy_from_yaml_through_the_plugin_init_args(tmp_path, monkeypatch):
    import lightning_mp.cli.app as cli

    config = tmp_path / "policy.yaml"
    config.write_text(
        "trainer:\n"
        "  plugins:\n"
        "    - class_path: lightning_mp.MixedPrecisionPlugin\n"
        "      init_args:\n"
        "        precision: bf16-mixed\n"
        "        policy: {preset: autocast, fp32_ops: [softmax]}\n"
    )
    seen = {}
    original = cli.MixedPrecisionCLI._instantiate_trainer

    def spy(self, trainer_config, callbacks):
        seen["trainer"] = original(self, trainer_config, callbacks)
        return seen["trainer"]

    monkeypatch.setattr(cli.MixedPrecisionCLI, "_instantiate_trainer", spy)
    digits = Path(__file__).resolve().parent.parent / "configs" / "digits.yaml"
    cli.main(
        [
            "fit",
            "--config",
            str(digits),
            "--config",
            str(config),
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.max_steps=1",
            "--trainer.precision=null",
            "--test_after_fit=false",
            "--trainer.limit_val_batches=0",
        ]
    )
    assert seen["trainer"].precision_plugin.policy == CastPolicy(fp32_ops=["softmax"])


def test_mixed_precision_section_takes_a_policy(monkeypatch):
    import lightning_mp.cli.choice as choice
    from lightning_mp.cli import plugin_for

    monkeypatch.setattr(choice, "_runs_on_cpu", lambda accelerator: False)
    plugin = plugin_for("bf16-mixed", "gpu", None, {"policy": {"preset": "fast", "fp32_modules": ["classifier"]}})
    assert plugin.policy == CastPolicy(preset="fast", fp32_modules=["classifier"])


def _compiled_loss(policy, compiled):
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0])
    torch.manual_seed(0)
    model = Head()
    plugin = MixedPrecisionPlugin("bf16-mixed", policy=policy)
    plugin.connect(model, [], [])
    run = torch.compile(model) if compiled else model
    try:
        with plugin.forward_context():
            return run(x, y).item()
    finally:
        plugin.teardown()


def test_op_rules_apply_under_torch_compile():
    """The compiled forward gives the eager-with-policy result, not the eager-without-policy one."""
    policy = {"fp32_ops": ["softmax", "linear", "layer_norm"]}
    eager_policy, eager_default = _compiled_loss(policy, False), _compiled_loss(None, False)
    compiled = _compiled_loss(policy, True)
    assert eager_policy != eager_default  # the policy changes the arithmetic (all fp32 here)
    assert abs(compiled - eager_policy) <= 1e-5 < abs(compiled - eager_default)


def test_module_rules_apply_under_torch_compile():
    policy = {"fp32_ops": ["softmax"], "fp32_modules": ["norm", "classifier"]}
    eager_policy, eager_default = _compiled_loss(policy, False), _compiled_loss(None, False)
    compiled = _compiled_loss(policy, True)
    assert eager_policy != eager_default
    assert abs(compiled - eager_policy) <= 1e-5 < abs(compiled - eager_default)
