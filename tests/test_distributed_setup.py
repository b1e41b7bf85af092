"""Strategy checks made before training: DeepSpeed refused with how to configure its own fp16/bf16; reduce_dtype."""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy

from lightning_mp import MixedPrecisionPlugin
from lightning_mp.distributed import sync_for
from tests.helpers import TinyRegressor, regression_loader

CUDA_AND_DEEPSPEED = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("deepspeed") is None,
    reason="needs a CUDA device and the deepspeed package (Lightning's DeepSpeedStrategy runs only there)",
)


def test_deepspeed_is_refused_with_how_to_configure_its_own_fp16_and_bf16():
    # deepspeed is not installed here, so DeepSpeedStrategy.__init__ cannot run; the check only reads the type
    strategy = DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    with pytest.raises(ValueError) as error:
        sync_for(strategy, MixedPrecisionPlugin(master_weights=True))
    message = str(error.value)
    for fragment in (
        "DeepSpeedStrategy",
        "own loss scaler",
        "precision='16-mixed'",
        "precision='bf16-mixed'",
        '"fp16": {"enabled": true',
        '"bf16": {"enabled": true}',
        "initial_scale_power",
    ):
        assert fragment in message, fragment


@pytest.mark.gpu
@CUDA_AND_DEEPSPEED
def test_deepspeed_trainer_is_refused_before_the_first_step():
    model = TinyRegressor()
    trainer = L.Trainer(
        accelerator="cuda",
        devices=1,
        strategy="deepspeed_stage_2",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        plugins=[MixedPrecisionPlugin()],
    )
    with pytest.raises(ValueError, match="DeepSpeed runs its own loss scaler"):
        trainer.fit(model, regression_loader())
    assert trainer.global_step == 0


@pytest.mark.parametrize(
    "value, expected",
    [
        ("float32", torch.float32),
        (torch.bfloat16, torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("torch.float16", torch.float16),
    ],
)
def test_reduce_dtype_accepts_dtypes_and_their_names(value, expected):
    assert MixedPrecisionPlugin(reduce_dtype=value).reduce_dtype == expected


@pytest.mark.parametrize("value", ["float64", torch.int8, 16, None])
def test_reduce_dtype_rejects_anything_else_naming_the_allowed_values(value):
    with pytest.raises(ValueError, match=r"reduce_dtype=.* is not supported: use torch.float32 \(the default\)"):
        MixedPrecisionPlugin(reduce_dtype=value)


def test_fsdp1_strategy_is_refused_with_what_to_use_instead():
    from lightning.pytorch.strategies import FSDPStrategy

    with pytest.raises(ValueError) as error:
        sync_for(FSDPStrategy(), MixedPrecisionPlugin())
    message = str(error.value)
    for fragment in (
        "Lightning's FSDPStrategy (FSDP1)",
        "ModelParallelStrategy(data_parallel_size=",
        "fsdp2_policy()",
        "fully_shard(block",
        "strategy='ddp'",
    ):
        assert fragment in message, fragment


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (Lightning's FSDPStrategy runs only there)"
)
@pytest.mark.parametrize("masters", [True, "remainder"])
def test_fsdp1_on_one_gpu_is_refused_before_the_first_step(masters):
    """Where FSDP1 really runs (CUDA): the plugin with masters under ``strategy="fsdp"`` is refused while the Trainer
    is built, by Lightning's own check (its strategy takes only an ``FSDPPrecision``), before any of our code or any
    step runs (seen on an H100, 2026-11-26). Troubleshooting lists this message with what to use instead."""
    precision = "bf16-mixed" if masters == "remainder" else "16-mixed"
    with pytest.raises(TypeError, match="The FSDP strategy can only work with the `FSDPPrecision` plugin"):
        L.Trainer(
            accelerator="cuda", devices=1, strategy="fsdp", max_steps=1, logger=False, enable_checkpointing=False,
            plugins=[MixedPrecisionPlugin(precision, master_weights=masters)],
        )  # fmt: skip


def test_fsdp_param_groups_reads_either_torch_layout_of_the_fsdp_state():
    """torch >= 2.12 keeps a list ``_fsdp_param_groups``; torch 2.11 (the GPU machines') one ``_fsdp_param_group``:
    missed, every FSDP2 world-size-1 run on the GPU was refused as 'not sharded' (found by the GPU run, 2026-11-26)."""
    from types import SimpleNamespace

    from lightning_mp.distributed.shard import fsdp_param_groups

    def module(**state):
        return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))

    assert fsdp_param_groups(module(_fsdp_param_groups=["a", "b"])) == ["a", "b"]
    assert fsdp_param_groups(module(_fsdp_param_group="a")) == ["a"]
    assert fsdp_param_groups(module(_fsdp_param_group=None)) == []
