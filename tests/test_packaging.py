"""The package as users install it: the licence, the sdist, what a wheel's messages point to, and a run without extras.

An installed wheel has the package only: no docs/, configs/, examples/, benchmarks/ or tests/, and no source tree
for ``pip install -e``. Its messages must not send a user to those files, and each optional package that is missing
is said in one line naming the extra that installs it. tests/without_extras.py runs every config of configs/ (and each
entry point that needs an extra) with the extras' packages made absent, in one process.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import tomllib

from lightning_mp.cli.errors import OPTIONAL_MODULES, missing_extra

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_mp"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
#: sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt, the text LICENSE must be (as many packages ship it)
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
#: Paths of the repository that no wheel carries; a message that names one sends a wheel user nowhere.
REPOSITORY_ONLY = re.compile(r"\b(RESULTS\.md|HISTORY\.md|CHANGELOG|benchmarks/|docs/|examples/|tests/|configs/)")


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _strings(path: Path, docstrings: bool) -> list[tuple[int, str]]:
    """The string constants of a module (the literal parts of f-strings too), with or without docstrings."""
    tree = _tree(path)
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (docstrings or id(node) not in docs)
    ]


def _requirement_names(extra: str) -> set[str]:
    """The distributions an extra installs (an extra made of others, ``lightning_mp[a,b]``, counts theirs)."""
    names = set()
    for requirement in EXTRAS[extra]:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower()
        inner = re.search(r"\[(.*)\]", requirement) if name == "lightning_mp" else None
        names |= {n for part in inner.group(1).split(",") for n in _requirement_names(part)} if inner else {name}
    return names


def test_license_is_the_apache_2_text_and_declared_as_spdx():
    assert hashlib.sha256((ROOT / "LICENSE").read_bytes()).hexdigest() == APACHE_2_SHA256
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    # setuptools reads an SPDX string and license-files from 77 on (older ones refuse the string)
    assert any(
        re.fullmatch(r"setuptools>=(\d+)", r) and int(r[12:]) >= 77 for r in PYPROJECT["build-system"]["requires"]
    )


def test_no_message_points_to_a_file_a_wheel_lacks():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text[:120]!r}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in _strings(path, docstrings=False)
        if REPOSITORY_ONLY.search(text)
    ]
    assert not found, "messages that name a file of the repository, which an installed wheel lacks:\n" + "\n".join(
        found
    )


def test_every_install_hint_works_for_a_wheel_and_names_an_extra_that_exists():
    hints, editable = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _strings(path, docstrings=True):
            hints |= set(re.findall(r"lightning_mp\[([a-z0-9_,-]+)\]", text))
            if re.search(r"pip install -e\b", text):
                editable.append(f"{path.relative_to(ROOT)}:{line}")
        hints |= {  # the samples' hints are built by install_extra("samples")
            node.args[0].value
            for node in ast.walk(_tree(path))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "install_extra" and node.args
        }
    assert not editable, f"`pip install -e` needs the source tree, which a wheel user does not have: {editable}"
    assert {"samples", "diagnostics", "fp8"} <= hints  # the hints the package gives
    assert hints <= set(EXTRAS), hints - set(EXTRAS)


@pytest.mark.parametrize("module", sorted(OPTIONAL_MODULES))
def test_each_optional_module_belongs_to_the_extra_the_cli_names(module):
    distribution, extra = OPTIONAL_MODULES[module]
    assert distribution in _requirement_names(extra)


def test_a_bare_missing_module_gets_its_extra_said_after_it():
    try:
        try:
            import sklearn_not_here  # noqa: F401
        except ModuleNotFoundError as err:
            err.name = "sklearn.datasets"  # what `from sklearn.datasets import ...` raises without scikit-learn
            raise ValueError("jsonargparse wraps what the model raised") from err
    except ValueError as wrapped:
        line = missing_extra(wrapped)
    assert line is not None and line.endswith(
        'scikit-learn comes with the samples extra: pip install "lightning_mp[samples]".'
    )
    assert missing_extra(ValueError("no import involved")) is None


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory):
    out = tmp_path_factory.mktemp("without_extras")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "without_extras.py"), str(out)], capture_output=True, text=True, cwd=out
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out, json.loads((out / "outcomes.json").read_text())


#: What each config gives without any extra (configs/ and this table are checked to name the same configs): the
#: extra named in its one line, or "result" (it trains), or the start of a one-line error that is not about an extra.
CONFIG_OUTCOMES = {
    "bert": "samples",
    "bert-imdb": "samples",
    "digits": "samples",
    "gpt": "result",  # with a local text file for the Shakespeare download; the report says it has no figure
    "resnet18-mnist": "source='mnist': folder 'mnist' does not exist",
}


def _one_error_line(outcome: dict) -> str:
    assert outcome["kind"] == "exit" and outcome["code"] == 2, outcome
    lines = [line for line in outcome["stderr"].splitlines() if line.startswith("lightning_mp: error:")]
    assert len(lines) == 1 and "Traceback" not in outcome["stderr"], outcome["stderr"]
    return lines[0]


def test_the_table_covers_every_config():
    assert sorted(CONFIG_OUTCOMES) == sorted(path.stem for path in (ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(CONFIG_OUTCOMES))
def test_every_config_without_extras_gives_a_result_or_one_line(without_extras, name):
    out, outcomes = without_extras
    outcome, expected = outcomes[f"config:{name}"], CONFIG_OUTCOMES[name]
    if expected == "result":
        assert outcome["kind"] == "result", outcome
        report = next((out / name).rglob("precision_report.md")).read_text()
        assert (
            'No figure: The precision report\'s PNG needs matplotlib, which is not installed: pip install "lightning_mp[diagnostics]"'
            in report
        )
    elif expected in EXTRAS:
        assert f'pip install "lightning_mp[{expected}]"' in _one_error_line(outcome)
    else:
        assert _one_error_line(outcome).startswith(f"lightning_mp: error: {expected}")


@pytest.mark.parametrize(
    "name, extra, error",
    [
        ("cli:gpt+fp8", "fp8", None),
        ("api:fp8", "fp8", "ImportError"),
        ("api:png", "diagnostics", "ImportError"),
        ("api:digits", "samples", "MissingExtraError"),
        ("api:bert", "samples", "MissingExtraError"),
        ("api:tokenizer", "samples", "MissingExtraError"),
    ],
)
def test_each_extra_hint_is_one_line_naming_the_extra(without_extras, name, extra, error):
    outcome = without_extras[1][name]
    if error is None:  # the command line
        line = _one_error_line(outcome)
    else:  # the library and the samples called from Python: an ImportError (MissingExtraError is one) in one line
        assert (outcome["kind"], outcome["type"]) == ("exception", error), outcome
        line = outcome["message"]
        assert "\n" not in line
    assert f'pip install "lightning_mp[{extra}]"' in line


def test_sdist_carries_the_package_and_none_of_the_tests(tmp_path):
    """The sdist builds the wheel; the tests stay in the repository (they need its docs/, configs/, examples/ and
    benchmarks/, which no sdist carries). Built here with setuptools' own backend on a copy of what it reads (about
    2 s, no network, nothing written into the checkout); MANIFEST.in's ``prune tests`` is what keeps them out."""
    for name in ("pyproject.toml", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tmp_path / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for folder in ("lightning_mp", "tests"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=ignore)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, "dist"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    with tarfile.open(tmp_path / "dist" / done.stdout.strip().splitlines()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
        info = sdist.extractfile(next(m for m in sdist.getmembers() if m.name.endswith("/PKG-INFO"))).read().decode()
    assert not {name for name in names if name.startswith("tests/")}
    sources = {str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*") if p.suffix in (".py", ".c", ".h")}
    assert sources <= names, sources - names
    assert {"LICENSE", "README.md", "pyproject.toml"} <= names
    assert "License-Expression: Apache-2.0" in info and "License-File: LICENSE" in info
