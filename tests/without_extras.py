"""Run as a script: what a user without the optional packages meets, as JSON (``python tests/without_extras.py DIR``).

The packages of the extras (scikit-learn, transformers, matplotlib, torchao) are made "not installed" before anything
is imported: their modules cannot be imported (``sys.modules[name] = None``, which ``importlib.util.find_spec`` also
reports as missing) and their distributions have no metadata (torchmetrics decides by the metadata whether to import
matplotlib and transformers). Then each config in configs/ runs through ``python -m lightning_mp``'s ``main`` for one
step, and each library entry point that needs an extra is called. Every outcome is recorded: ``"result"`` (returned),
``"exit"`` (SystemExit, with what the CLI printed on stderr), or ``"exception"`` (what would have been a traceback).
One process for all of it: the imports are paid once (tests/test_packaging.py reads the JSON).

``python tests/without_extras.py -m lightning_mp ARGS`` runs ``python -m lightning_mp ARGS`` without the extras
instead, its output untouched (tests/test_cli_entry.py).
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

#: module -> distribution of the packages made absent
ABSENT = {"sklearn": "scikit-learn", "transformers": "transformers", "matplotlib": "matplotlib", "torchao": "torchao"}


def _absent(name: str) -> bool:
    return name.lower().replace("_", "-") in set(ABSENT.values()) | set(ABSENT)


def _without(real):
    def lookup(name):
        if _absent(name):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    return lookup


for _module in ABSENT:
    sys.modules[_module] = None  # type: ignore[assignment]
metadata.distribution, metadata.version = _without(metadata.distribution), _without(metadata.version)

import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _outcome(call) -> dict:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            call()
    except SystemExit as exit:
        return {"kind": "exit", "code": exit.code, "stderr": stderr.getvalue()}
    except Exception as error:
        return {"kind": "exception", "type": type(error).__name__, "message": str(error), "stderr": stderr.getvalue()}
    return {"kind": "result", "stderr": stderr.getvalue()}


def _cli(out: Path, name: str, *extra: str):
    from lightning_mp.cli import main

    short = [
        f"--trainer.default_root_dir={out / name}",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=1",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.enable_progress_bar=false",
    ]
    config = ROOT / "configs" / f"{name.split('+')[0]}.yaml"
    return lambda: main(["fit", "--config", str(config), *short, *extra])


def main(out: Path) -> None:
    text = out / "text.txt"  # gpt.yaml's Shakespeare is a download: a local text file stands in for it
    text.write_text("To be, or not to be, that is the question. " * 200)
    gpt_offline = ("--data.init_args.source=file", f"--data.init_args.path={text}", "--data.init_args.block_size=32")
    gpt_small = (
        "--trainer.val_check_interval=1",
        "--model.init_args.n_layer=1",
        "--model.init_args.n_embd=32",
        "--model.init_args.block_size=32",
    )
    calls = {
        f"config:{path.stem}": _cli(out, path.stem)
        for path in sorted((ROOT / "configs").glob("*.yaml"))
        if path.stem != "gpt"
    }
    calls["config:gpt"] = _cli(out, "gpt", *gpt_offline, *gpt_small)
    calls["cli:gpt+fp8"] = _cli(out, "gpt+fp8", *gpt_offline, *gpt_small, "--mixed_precision.fp8=tensorwise")

    def fp8():
        from lightning_mp import MixedPrecisionPlugin

        MixedPrecisionPlugin("bf16-mixed", fp8="tensorwise")

    def png():
        from lightning_mp.diagnostics.plots import _matplotlib

        _matplotlib()

    def digits():
        from lightning_mp.samples import ImageDataModule

        ImageDataModule(source="digits").setup("fit")

    def bert():
        from lightning_mp.samples import BertClassifier

        BertClassifier(pretrained=False)

    def tokenizer():
        from lightning_mp.samples.data.sentiment import load_tokenizer

        load_tokenizer("minilm")

    calls.update({"api:fp8": fp8, "api:png": png, "api:digits": digits, "api:bert": bert, "api:tokenizer": tokenizer})
    results = {name: _outcome(call) for name, call in calls.items()}
    (out / "outcomes.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "-m":  # `python tests/without_extras.py -m lightning_mp fit ...`: as `python -m` runs it
        import runpy

        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        main(Path(sys.argv[1]))
