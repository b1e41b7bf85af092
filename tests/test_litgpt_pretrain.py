"""LitGPT's ``pretrain`` as a tested client: ``litgpt.pretrain.main(fabric, ...)`` with a Fabric carrying the plugin,
on a tiny Llama config and local text files through LitGPT's ``TextFiles`` data module (tokenized once by litdata's
``optimize``, one worker per split, then read back by every run), against Lightning's built-in ``bf16-mixed``.

``pretrain`` initialises the model itself (no checkpoint to load), clips by norm every step (``--train.max_norm`` is
required), and saves and resumes its whole state (model, optimizer, litdata's loader position) with ``fabric.save``
/ ``fabric.load``. ``torch.compile(model)`` in ``pretrain.main`` runs with dynamo disabled here: compiling the model on
a CPU takes minutes and is no part of the precision path under test.
"""

from __future__ import annotations

import functools
import multiprocessing
import random
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch

pytest.importorskip("litgpt")
pytest.importorskip("litdata")

from lightning_mp import MixedPrecisionPlugin
from tests.test_litgpt_recipes import WORDS, Losses, build_checkpoint, runner

pytestmark = pytest.mark.filterwarnings("ignore")
MODES = {"fp32": True, "remainder": "remainder"}
BUILTIN = ("bf16-mixed", "32-true")
STEPS, BATCH, SEQ = 4, 4, 64


def text_files(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """One ``.txt`` file for training and one for validation, tokenized by ``TextFiles.prepare_data`` (litdata)."""
    import litdata
    from litgpt import Tokenizer
    from litgpt.data import TextFiles

    rng = random.Random(1)
    paths = {"train": root / "train", "val": root / "val"}
    for path in paths.values():
        path.mkdir()
        sentences = (" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(300))
        (path / "text.txt").write_text(". ".join(sentences))
    data = TextFiles(train_data_path=paths["train"], val_data_path=paths["val"], num_workers=0)
    data.connect(Tokenizer(tokenizer_dir), batch_size=BATCH, max_seq_length=SEQ)
    start_method = multiprocessing.get_start_method(allow_none=True)
    # litdata's own ``start_method`` option, which TextFiles leaves at its default ("spawn"): a forked worker writes
    # the same chunks byte for byte, without the ~8 s a spawned one takes to import litgpt and Lightning again
    fork = "fork" if sys.platform.startswith("linux") else None  # elsewhere litdata's default
    forked = functools.partial(litdata.optimize, start_method=fork)
    try:
        with mock.patch.object(litdata, "optimize", forked):  # TextFiles imports it from litdata at the call
            data.prepare_data()  # litdata's optimize: one worker per split (one file each)
    finally:
        multiprocessing.set_start_method(start_method, force=True)  # litdata sets its start method process-wide
    return paths


def run(mode: Any, corpus: dict, out: Path, resume: Any = False, steps: int = STEPS) -> dict:
    """One ``pretrain.main`` run (``mode``: a master mode, or one of ``BUILTIN``, Lightning's own precision): the
    logged losses and the final weights."""
    from litgpt import Config, Tokenizer, pretrain
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import TextFiles

    logger = Losses()
    builtin = mode in BUILTIN
    plugins = [] if builtin else [MixedPrecisionPlugin("bf16-mixed", master_weights=mode)]
    precision = {"precision": mode} if builtin else {}
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger], plugins=plugins, **precision)
    ckpt = corpus["tokenizer_dir"]
    data = TextFiles(train_data_path=corpus["train"], val_data_path=corpus["val"], num_workers=0)
    train = TrainArgs(
        save_interval=2, log_interval=1, global_batch_size=BATCH, micro_batch_size=BATCH, max_tokens=steps * BATCH * SEQ,
        max_norm=1.0, min_lr=1e-4, lr_warmup_steps=1, max_seq_length=SEQ,
    )  # fmt: skip
    evaluate = EvalArgs(interval=1000, max_iters=2, initial_validation=False, final_validation=False)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-3}}
    saved_argv, sys.argv = sys.argv, ["litgpt", "tiny-llama"]  # save_hyperparameters parses sys.argv
    try:
        with warnings.catch_warnings(), torch._dynamo.config.patch(disable=True):
            warnings.simplefilter("ignore")
            pretrain.main(
                fabric, 1, 42, None, resume, Config.from_file(ckpt / "model_config.yaml"), data, out, ckpt,
                Tokenizer(ckpt), train, evaluate, optimizer,
            )  # fmt: skip
    finally:
        sys.argv = saved_argv
    state = torch.load(out / "final" / "lit_model.pth", weights_only=True)
    return {"losses": logger.losses, "weights": state["model"], "out": out}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pretrain")
    tokenizer_dir = build_checkpoint(root)
    return {"tokenizer_dir": tokenizer_dir, **text_files(root, tokenizer_dir)}


@pytest.fixture(scope="module")
def runs(corpus) -> dict:
    root = corpus["train"].parent
    modes = {**MODES, **{name: name for name in BUILTIN}}
    return {name: run(mode, corpus, root / f"out-{name}") for name, mode in modes.items()}


@pytest.mark.parametrize("mode", MODES)
def test_pretrain_tracks_the_builtin_bf16_mixed_within_bf16s_own_spread(runs, mode):
    ours, builtin, fp32 = (runs[name]["losses"] for name in (mode, "bf16-mixed", "32-true"))
    assert len(ours) == len(builtin) == len(fp32) == STEPS
    # what bf16 rounding alone does to this run: how far the built-in bf16-mixed ends from the fp32 run, step by step
    spread = max(abs(b - f) for b, f in zip(builtin, fp32))
    assert 0 < spread < 0.01 * fp32[-1]
    assert max(abs(o - b) for o, b in zip(ours, builtin)) <= 2 * spread
    assert ours[0] == pytest.approx(builtin[0], rel=2**-8)  # the same init: one forward, to bf16 resolution
    assert ours[-1] < ours[0]  # it trains
    assert all(value.dtype == torch.float32 for value in runs[mode]["weights"].values())


@pytest.mark.parametrize("mode", MODES)
def test_pretrain_resumes_auto_as_the_uninterrupted_run(runs, corpus, mode):
    uninterrupted = runs[mode]
    out = uninterrupted["out"].with_name(uninterrupted["out"].name + "-resumed")
    shutil.copytree(uninterrupted["out"] / "step-00000002", out / "step-00000002")
    resumed = run(MODES[mode], corpus, out, resume="auto")
    assert resumed["losses"] == uninterrupted["losses"][2:]
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


def test_the_runner_refuses_pretrain_with_optimizer_in_backward_before_any_work(tmp_path, capsys):
    argv = ["--optimizer-in-backward", "pretrain", "tiny-llama", "--out_dir", str(tmp_path / "out")]
    before = runner.PluginFabric.last_plugin
    with pytest.raises(SystemExit) as refused:
        runner.main(argv)
    message = str(refused.value.code)
    assert "--optimizer-in-backward cannot run pretrain" in message and "clips gradients by norm" in message
    assert "finetune_full" in message and "\n" not in message  # one line, saying what runs instead
    assert runner.PluginFabric.last_plugin is before and L.Fabric is runner._FABRIC  # no Fabric was built
    assert not (tmp_path / "out").exists() and capsys.readouterr().out == ""


def test_the_runner_runs_litgpt_pretrain_cli_and_names_the_plugin(corpus, capsys):
    ckpt, out = corpus["tokenizer_dir"], corpus["train"].parent / "cli"
    argv = ["--master-weights", "true", "pretrain", "tiny-llama", "--model_config", str(ckpt / "model_config.yaml")]
    argv += ["--tokenizer_dir", str(ckpt), "--out_dir", str(out), "--data", "TextFiles", "--data.num_workers", "0"]
    argv += ["--data.train_data_path", str(corpus["train"]), "--data.val_data_path", str(corpus["val"])]
    argv += ["--train.max_tokens", str(2 * BATCH * SEQ), "--train.micro_batch_size", str(BATCH), "--devices", "1"]
    argv += ["--train.global_batch_size", str(BATCH), "--train.max_seq_length", str(SEQ), "--logger_name", "csv"]
    argv += ["--train.lr_warmup_steps", "1", "--eval.max_iters", "2"]
    with warnings.catch_warnings(), torch._dynamo.config.patch(disable=True):
        warnings.simplefilter("ignore")
        runner.main(argv)
    plugin = runner.PluginFabric.last_plugin
    assert plugin.master_weights is True and L.Fabric is runner._FABRIC
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lightning_mp:")]
    assert lines == [f"lightning_mp: {plugin!r}"]
    assert (
        lines[0].startswith("lightning_mp: MixedPrecisionPlugin(precision='bf16-mixed', ")
        and "master_weights=True" in lines[0]
    )
    weights = torch.load(out / "final" / "lit_model.pth", weights_only=True)["model"]
    assert weights and all(value.dtype == torch.float32 for value in weights.values())


def test_the_plugins_repr_names_optimizer_in_backward():
    inside = repr(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder", optimizer_in_backward=True))
    assert "master_weights='remainder', optimizer_in_backward=True, policy=" in inside
    assert "optimizer_in_backward" not in repr(MixedPrecisionPlugin("bf16-mixed", master_weights="remainder"))
