"""FSDP2 + fp8 on 2 real processes (gloo, CPU emulation; tests/distributed/fp8_fsdp2_checks.py): sharding before
conversion is refused at setup, ``plugin.fsdp2_shard`` converts and shards in the right order, and checkpoints hold
plain fp32 tensors that load strictly into an unconverted model and resume bit-exactly."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_mp import MixedPrecisionPlugin
from tests.distributed.common import load_ranks
from tests.distributed.launch import launch

pytest.importorskip("torchao")

FP8_LAYERS = {"0": "FSDPFloat8Linear", "3": "FSDPFloat8Linear", "5": "Linear"}  # net.5: the output projection


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8-fsdp2")
    launch("fp8_fsdp2_checks.py", str(out), timeout=300)
    return out


@pytest.fixture(scope="module")
def ranks(out):
    return load_ranks(out)


def _equal_weights(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize("run", ["refused", "refused_root"])
def test_sharding_before_fp8_conversion_is_refused_at_setup_before_any_step(ranks, run):
    """fully_shard without fp8_convert first: on each Linear (FSDPLinear: refused, not skipped as a subclass and
    trained in bf16 with a warning that no layer is eligible), or on the root only."""
    for rank in ranks:
        refused = rank[run]
        assert refused["losses"] == []
        assert "layers net.0, net.3 were sharded with fully_shard before being converted to fp8" in refused["error"]
        assert "fp8_convert(self) before fully_shard" in refused["error"] and "fsdp2_shard(self" in refused["error"]


def test_fsdp2_shard_converts_then_shards_like_the_manual_order(ranks):
    for rank in ranks:
        manual, helper = rank["manual"], rank["helper-True"]
        assert helper["losses"] == manual["losses"] and _equal_weights(helper["weights"], manual["weights"])
        layers = {name: kind for name, kind in helper["layers"].items() if name in FP8_LAYERS}
        assert layers == FP8_LAYERS and helper["layers"]["2"] == "FSDPLayerNorm"  # the norm in a group of its own
        assert helper["norm_dtypes"] == ["torch.float32"]  # ... so it computes in fp32 with master weights
        kinds = helper["weight_kinds"]  # torchao's fp8 all-gather wraps the fp8 layers' weights
        assert kinds["net.0.weight"] == kinds["net.3.weight"] == "WeightWithDynamicFloat8CastTensor"
        assert kinds["net.5.weight"] == "Tensor" and helper["warnings"] == []
    assert _equal_weights(ranks[0]["helper-True"]["weights"], ranks[1]["helper-True"]["weights"])


@pytest.mark.parametrize("masters", ["", "_remainder"])
def test_fsdp2_shard_without_fp8_shards_in_the_same_order_as_by_hand(ranks, masters):
    for rank in ranks:
        plain, helper = rank[f"plain{masters}"], rank[f"helper_plain{masters}"]
        assert "error" not in helper and len(helper["losses"]) == 8, helper.get("error")
        assert helper["losses"] == plain["losses"] and _equal_weights(helper["weights"], plain["weights"])
        assert helper["layers"] == {
            "0": "FSDPLinear",
            "1": "GELU",
            "2": "FSDPLayerNorm",
            "3": "FSDPLinear",
            "4": "GELU",
            "5": "Linear",
        }
        assert helper["norm_dtypes"] == ["torch.float32"] and helper["warnings"] == []


@pytest.mark.parametrize(
    "run, resumed", [("helper-True", "resumed-True"), ("helper-False", "resumed-False"), ("file", "file_resumed")]
)
def test_fp8_fsdp2_run_resumed_from_its_checkpoint_continues_bit_exactly(ranks, run, resumed):
    """Resumed from the checkpoint written after epoch 0 (distributed with and without masters; single file)."""
    for rank in ranks:
        full, again = rank[run], rank[resumed]
        assert len(full["losses"]) == 8 and again["losses"] == full["losses"][4:]
        assert _equal_weights(again["weights"], full["weights"])


@pytest.mark.parametrize(
    "run, folder", [("helper-True", "ckpt-on"), ("helper-False", "ckpt-off"), ("file", "ckpt-file")]
)
def test_fp8_fsdp2_checkpoint_holds_plain_fp32_tensors_that_load_strictly_into_an_unconverted_model(
    out, ranks, tmp_path, run, folder
):
    from lightning_mp.cli.consolidate import consolidate
    from tests.distributed.fp8_fsdp2_checks import Net

    last = out / folder / "epoch=1.ckpt"  # the end of the run
    if run == "file":
        state = torch.load(last, weights_only=True)["state_dict"]  # no torchao class needed to read it
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        entries = dcp.FileSystemReader(str(last)).read_metadata().state_dict_metadata
        model_entries = {key: entry for key, entry in entries.items() if key.startswith("state_dict.")}
        assert all(isinstance(entry, TensorStorageMetadata) for entry in model_entries.values())
        assert {entry.properties.dtype for entry in model_entries.values()} == {torch.float32}
        consolidate(last, tmp_path / "model.pt")
        state = torch.load(tmp_path / "model.pt", weights_only=True)
    # the live state_dict holds torchao's fp8 all-gather wrappers (inside DTensors); what Lightning saved does not
    assert ranks[0][run]["state_dict_kinds"] == ["Tensor", "WeightWithDynamicFloat8CastTensor"]
    assert {type(value) for value in state.values()} == {torch.Tensor}  # no float8 or FSDP subclass
    assert {value.dtype for value in state.values()} == {torch.float32}
    model = Net()  # as built: never converted, never sharded
    model.load_state_dict(state, strict=True)
    assert _equal_weights({name: p.detach() for name, p in model.named_parameters()}, ranks[0][run]["weights"])


def test_fsdp2_shard_refuses_a_root_or_blocks_outside_the_model_and_a_missing_mesh():
    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights=True)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"root=\.\.\.\): the Linear is not Sequential or one of its submodules"):
        plugin.fsdp2_shard(model, root=nn.Linear(16, 16))
    with pytest.raises(ValueError, match=r"blocks=\.\.\.\): \['Sequential'\] are not submodules of the root Linear"):
        plugin.fsdp2_shard(model, blocks=[model], root=model[0])
    with pytest.raises(ValueError, match="Sequential has no device_mesh .* pass mesh="):
        plugin.fsdp2_shard(model, blocks=[model[0]])


def test_fp8_setup_table_is_logged_once_when_fp8_convert_ran_before_convert_module(caplog):
    plugin = MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    with caplog.at_level(logging.INFO):
        plugin.fp8_convert(model)
        plugin.convert_module(model)  # what Lightning calls after configure_model: nothing new to convert
    tables = [r for r in caplog.records if r.getMessage().startswith("lightning_mp fp8 (tensorwise")]
    assert len(tables) == 1 and plugin.fp8.converted == ["0"]
