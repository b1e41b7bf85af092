"""LitGPT's own recipes as tested clients: ``litgpt.finetune.full``, ``lora`` and ``adapter`` ``main(fabric, ...)``
with a Fabric carrying the plugin (both master modes), on a tiny checkpoint directory built here (config,
``lit_model.pth``, a ``tokenizer.json`` trained with ``tokenizers``, a JSON instruction set).

LitGPT loads its checkpoint after ``fabric.setup`` with ``lazy_load`` (``NotYetLoadedTensor`` values): each run must
equal, bit for bit, the same run loading real tensors; its first loss must be the built-in ``bf16-mixed`` run's; the
saved weights are fp32 and load with LitGPT; the full recipe resumes as the uninterrupted run. ``pretrain``:
tests/test_litgpt_pretrain.py.
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

pytest.importorskip("litgpt")
pytest.importorskip("tokenizers")

from lightning.fabric.loggers import Logger

from lightning_mp import MixedPrecisionPlugin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import litgpt_recipes as runner

pytestmark = pytest.mark.filterwarnings("ignore")
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "the",
    "dog",
    "ran",
    "to",
    "the",
    "park",
    "while",
    "birds",
    "sang",
    "songs",
    "in",
    "tall",
    "green",
    "trees",
]
MODES = {"fp32": True, "remainder": "remainder"}


def build_checkpoint(root: Path) -> Path:
    """A Llama-shaped LitGPT checkpoint directory of 2 layers, width 32, and ``data.json`` next to it."""
    from litgpt import Config
    from litgpt.model import GPT
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    ckpt = root / "tiny-llama"
    ckpt.mkdir(parents=True)
    rng = random.Random(0)
    text = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(200)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer.save(str(ckpt / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(special))
    config = Config(
        name="tiny-llama", block_size=128, vocab_size=tokenizer.get_vocab_size(), padded_vocab_size=128, n_layer=2,
        n_head=2, n_embd=32, n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64,
    )  # fmt: skip
    save_config(config, ckpt)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), ckpt / "lit_model.pth")
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    data = [{"instruction": sentence(6), "input": "", "output": sentence(4)} for _ in range(40)]
    (root / "data.json").write_text(json.dumps(data))
    return ckpt


class Losses(Logger):
    """Keeps the training losses LitGPT logs."""

    name, version = "losses", 0

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def log_metrics(self, metrics: dict[str, Any], step: Any = None) -> None:
        if "loss" in metrics:
            self.losses.append(float(metrics["loss"]))

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass


def run(
    recipe: str,
    mode: Any,
    ckpt: Path,
    out: Path,
    resume: Any = False,
    steps: int = 4,
    in_backward: bool = False,
    **train: Any,
) -> dict:
    """One recipe run through its ``main(fabric, ...)``: the losses and the final weights (``mode``: a master mode,
    or ``"builtin"`` for Lightning's own ``bf16-mixed``; ``in_backward``: ``optimizer_in_backward=True``)."""
    from litgpt.args import EvalArgs, TrainArgs
    from litgpt.data import JSON
    from litgpt.finetune import adapter, full, lora

    logger = Losses()
    precision = {"precision": "bf16-mixed"} if mode == "builtin" else {}
    plugin = (
        None
        if mode == "builtin"
        else MixedPrecisionPlugin("bf16-mixed", master_weights=mode, optimizer_in_backward=in_backward)
    )
    plugins = [plugin] if plugin is not None else []
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger], plugins=plugins, **precision)
    module = {"full": full, "lora": lora, "adapter": adapter}[recipe]
    # LoRA as LitGPT's setup() configures it by default (its merge at the end rebuilds the model from those)
    lora = {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.05, "lora_query": True, "lora_value": True}
    extra = {"lora": lora, "adapter": {"adapter_start_layer": 0}}.get(recipe, {})  # adapters in both layers
    config = module.Config.from_file(ckpt / "model_config.yaml", **extra)
    train_args = TrainArgs(
        save_interval=train.pop("save_interval", None), log_interval=1, global_batch_size=4, micro_batch_size=4,
        lr_warmup_steps=1, epochs=1, max_steps=steps, max_seq_length=64,
    )  # fmt: skip
    eval_args = EvalArgs(interval=1000, max_new_tokens=4, max_iters=2, initial_validation=False, final_validation=False)
    data = JSON(json_path=ckpt.parent / "data.json", val_split_fraction=0.2)
    optimizer = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 2e-3}}
    saved_argv, sys.argv = sys.argv, ["litgpt", str(ckpt)]  # LitGPT's save_hyperparameters parses sys.argv
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = (fabric, 1, resume) if recipe == "full" else (fabric, 1)
            module.main(*args, 1337, config, data, ckpt, out, train_args, eval_args, optimizer)
    finally:
        sys.argv = saved_argv
    final = (
        out / "final" / {"lora": "lit_model.pth.lora", "adapter": "lit_model.pth.adapter"}.get(recipe, "lit_model.pth")
    )
    weights = torch.load(final, weights_only=True)
    return {
        "losses": logger.losses, "weights": weights.get("model", weights), "config": config, "out": out,
        "steps_inside_backward": plugin is not None and plugin.steps.in_backward is not None,
    }  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("litgpt"))


@pytest.fixture(scope="module")
def runs(checkpoint) -> dict:
    """Each recipe and master mode, loading with LitGPT's lazy_load and with real tensors; the built-in run."""
    import litgpt.utils

    results: dict[Any, dict] = {}
    lazy_load = litgpt.utils.lazy_load
    for recipe in ("full", "lora", "adapter"):
        for name, mode in MODES.items():
            out = checkpoint.parent / f"{recipe}-{name}"
            results[(recipe, name, "lazy")] = run(recipe, mode, checkpoint, out, save_interval=2)
            litgpt.utils.lazy_load = lambda path: torch.load(path, weights_only=True)  # real tensors
            try:
                results[(recipe, name, "real")] = run(recipe, mode, checkpoint, out.with_name(out.name + "-real"))
            finally:
                litgpt.utils.lazy_load = lazy_load
    results["builtin"] = run("full", "builtin", checkpoint, checkpoint.parent / "full-builtin")
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("recipe", ["full", "lora", "adapter"])
def test_recipe_loading_lazily_equals_the_run_loading_real_tensors_bit_for_bit(runs, recipe, mode):
    lazy, real = runs[(recipe, mode, "lazy")], runs[(recipe, mode, "real")]
    assert lazy["losses"] == real["losses"] and len(lazy["losses"]) == 4
    assert lazy["weights"].keys() == real["weights"].keys()
    for key, value in lazy["weights"].items():
        assert value.dtype == torch.float32, key
        assert torch.equal(value, real["weights"][key]), key


@pytest.mark.parametrize("mode", MODES)
def test_first_loss_is_the_builtin_bf16_mixed_runs(runs, mode):
    # the same loaded fp32 weights: the model computes in bf16 (its weights and residual stream), the built-in
    # with fp32 weights under autocast, so the losses agree to bf16 resolution, not bitwise
    first = runs[("full", mode, "lazy")]["losses"][0]
    assert first == pytest.approx(runs["builtin"]["losses"][0], rel=2**-8)


def test_saved_weights_are_fp32_and_load_with_litgpt(runs, checkpoint):
    from litgpt.model import GPT

    full = runs[("full", "remainder", "lazy")]
    GPT(full["config"]).load_state_dict(full["weights"], strict=True)
    merged = torch.load(runs[("lora", "remainder", "lazy")]["out"] / "final" / "lit_model.pth", weights_only=True)
    assert all(value.dtype == torch.float32 for value in merged.values())
    GPT(full["config"]).load_state_dict(merged, strict=True)  # LoRA merged into the base weights by LitGPT


def test_full_recipe_resumes_as_the_uninterrupted_run(runs, checkpoint):
    uninterrupted = runs[("full", "remainder", "lazy")]
    step2 = uninterrupted["out"] / "step-000002" / "lit_model.pth"
    resumed = run("full", "remainder", checkpoint, checkpoint.parent / "full-resumed", resume=step2)
    assert resumed["losses"] == uninterrupted["losses"][2:]
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


@pytest.mark.parametrize("recipe", ["full", "lora", "adapter"])
def test_recipe_stepping_inside_backward_equals_the_normal_lean_step_bit_for_bit(runs, checkpoint, recipe):
    # LitGPT's own loop (fabric.backward, optimizer.step, zero_grad, scheduler.step) with optimizer_in_backward=True:
    # the backward updates, the step keeps the books; the same losses and saved weights as the normal lean step
    reference = runs[(recipe, "remainder", "lazy")]
    ours = run(recipe, "remainder", checkpoint, checkpoint.parent / f"{recipe}-inbackward", in_backward=True)
    assert ours["steps_inside_backward"]
    assert ours["losses"] == reference["losses"] and len(ours["losses"]) == 4
    assert ours["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        assert torch.equal(ours["weights"][key], value), key


def test_full_recipe_resumes_inside_backward_from_a_normal_steps_checkpoint(runs, checkpoint):
    uninterrupted = runs[("full", "remainder", "lazy")]
    step2 = uninterrupted["out"] / "step-000002" / "lit_model.pth"
    out = checkpoint.parent / "full-resumed-inbackward"
    resumed = run("full", "remainder", checkpoint, out, resume=step2, in_backward=True)
    assert resumed["losses"] == uninterrupted["losses"][2:]
    for key, value in uninterrupted["weights"].items():
        assert torch.equal(resumed["weights"][key], value), key


def test_the_runner_runs_litgpt_cli_with_the_plugin(checkpoint, capsys):
    out = checkpoint.parent / "cli"
    argv = ["--master-weights", "remainder", "finetune_full", str(checkpoint), "--out_dir", str(out)]
    argv += ["--data", "JSON", "--data.json_path", str(checkpoint.parent / "data.json"), "--data.val_split_fraction"]
    argv += ["0.2", "--train.max_steps", "2", "--train.global_batch_size", "4", "--train.micro_batch_size", "4"]
    argv += ["--train.lr_warmup_steps", "1", "--train.max_seq_length", "64", "--eval.final_validation", "false"]
    argv += ["--eval.initial_validation", "false", "--logger_name", "csv", "--devices", "1"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.main(argv)
    assert L.Fabric is runner._FABRIC  # given back
    assert getattr(runner.PluginFabric.last_plugin.masters, "kind", None) == "remainder"
    weights = torch.load(out / "final" / "lit_model.pth", weights_only=True)["model"]
    assert weights and all(value.dtype == torch.float32 for value in weights.values())
    # the same run stepping inside backward: the same saved weights, bit for bit
    argv = ["--optimizer-in-backward", *argv[2:4], "--out_dir", str(out.with_name("cli-inbackward")), *argv[6:]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.main(argv)
    assert runner.PluginFabric.last_plugin.optimizer_in_backward and runner.PluginFabric.optimizer_in_backward
    named = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lightning_mp: ")]
    assert len(named) == 2 and "optimizer_in_backward" not in named[0]  # one line a run, naming its options
    assert "master_weights='remainder', optimizer_in_backward=True, " in named[1]
    inside = torch.load(out.with_name("cli-inbackward") / "final" / "lit_model.pth", weights_only=True)["model"]
    assert inside.keys() == weights.keys() and all(torch.equal(inside[k], v) for k, v in weights.items())
