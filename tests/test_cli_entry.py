"""What a user meets first of `python -m lightning_mp`: its name and every subcommand in `--help`, a missing optional
package said alone before any other line, and no empty run folder behind a run that stopped before writing anything.

The name and the missing package are read from real subprocesses (`python -m lightning_mp`, and the same with the
extras' packages made absent by tests/without_extras.py), the two started together by a module fixture; the rest runs
in-process through the `main` they call.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_mp.cli import main
from lightning_mp.cli.app import SUBCOMMANDS
from lightning_mp.samples.resources import SourceUnavailableError
from tests.helpers import DigitsMLP, finished, started_per_test

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "configs" / "digits.yaml")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


#: the tests that read a real process: its command line (after ``python``), run in a fresh folder
PROCESSES = {
    "test_help_introduces_the_cli_as_python_dash_m_and_lists_every_subcommand_the_docs_use": [
        "-m", "lightning_mp", "--help",
    ],
    "test_a_missing_extra_is_the_only_line_and_leaves_no_run_folder": [
        str(ROOT / "tests" / "without_extras.py"), "-m", "lightning_mp", "fit", "--config", DIGITS,
    ],
}  # fmt: skip


def _run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *command], capture_output=True, text=True, timeout=300, cwd=cwd, env=ENV, check=False
    )


@pytest.fixture(scope="module")
def processes(request, tmp_path_factory):
    """The chosen tests' processes started together (each spends its seconds importing on one core), each in a folder
    of its own: ``{test: (its future, its folder)}``."""
    jobs = {name: lambda folder, name=name: _run(*PROCESSES[name], cwd=folder) for name in PROCESSES}
    with started_per_test(request, tmp_path_factory, jobs) as runs:
        yield runs


def test_help_introduces_the_cli_as_python_dash_m_and_lists_every_subcommand_the_docs_use(processes, request):
    done, _ = finished(processes, request)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: python -m lightning_mp ") and "__main__" not in done.stdout
    listed = done.stdout.split("Available subcommands:", 1)[1]
    for name, line in SUBCOMMANDS.items():  # each with its whole line (argparse wraps it)
        assert re.search(rf"^\s+{name}\s+(.*(?:\n\s{{20,}}.*)*)", listed, flags=re.M).group(1).split() == line.split()
    documented = {
        match
        for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
        for match in re.findall(r"python -m lightning_mp ([a-z]+)", page.read_text())
    }
    assert documented and documented <= set(SUBCOMMANDS), documented - set(SUBCOMMANDS)


@pytest.mark.parametrize("subcommand", ["fit", "consolidate"])
def test_each_subcommand_help_names_the_command_the_user_typed(subcommand, capsys):
    with pytest.raises(SystemExit) as exited:
        main([subcommand, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m lightning_mp {'[options] ' if subcommand == 'fit' else ''}{subcommand} ")
    assert " ".join(SUBCOMMANDS[subcommand].split()[:4]) in " ".join(out.split()) or subcommand == "consolidate"


def test_started_as_the_installed_script_the_usage_says_lightning_mp(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(Path(sys.prefix) / "bin" / "lightning-mp")])
    for command in (["--help"], ["consolidate", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
        assert capsys.readouterr().out.startswith(f"usage: lightning-mp {command[0] if len(command) > 1 else ''}")


def test_a_missing_extra_is_the_only_line_and_leaves_no_run_folder(processes, request):
    """digits.yaml without scikit-learn (of the samples extra): its one line, before anything else is printed."""
    done, folder = finished(processes, request)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "lightning_mp: error: source='digits' (scikit-learn's 8x8 digits) needs scikit-learn, which is not "
        'installed: pip install "lightning_mp[samples]" (or pip install scikit-learn).'
    ]
    assert not list(folder.iterdir())  # the config's default_root_dir runs/digits was never made


class MissingFilesData(L.LightningDataModule):
    """A data module refused at ``setup``, after the Trainer's logger made the run's folder."""

    def setup(self, stage: str) -> None:
        raise SourceUnavailableError("the data files are not there: pass path=")


class CrashingDigits(DigitsMLP):
    """A model whose first training step fails: the precision report is written into the run's folder."""

    def training_step(self, batch, batch_idx):
        raise RuntimeError("the model failed at its first step")

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)), batch_size=2)


def _fit(root: Path, *extra: str) -> None:
    main(
        [
            "fit",
            "--config",
            DIGITS,
            f"--trainer.default_root_dir={root}",
            "--trainer.max_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.precision=32-true",
            "--model=tests.helpers.DigitsMLP",
            *extra,
        ]
    )


def test_a_refusal_after_the_trainer_is_built_leaves_no_empty_run_folder(tmp_path, capsys):
    root = tmp_path / "runs" / "x"
    earlier = root / "lightning_logs" / "version_0"
    for where in (tmp_path / "fresh", root):
        with pytest.raises(SystemExit) as exited:
            _fit(where, "--data=tests.test_cli_entry.MissingFilesData")
        assert exited.value.code == 2
        assert "lightning_mp: error: the data files are not there: pass path=" in capsys.readouterr().err
        assert not (tmp_path / "fresh").exists()  # every folder it made, up to the root, is gone
        if where == root:
            assert sorted(p.relative_to(root) for p in root.rglob("*")) == [
                Path("lightning_logs"),
                Path("lightning_logs/version_0"),
                Path("lightning_logs/version_0/metrics.csv"),
            ]  # an earlier run's folder is kept whole, and no version_1 was left behind
        else:
            earlier.mkdir(parents=True)
            (earlier / "metrics.csv").write_text("step\n")


def test_a_run_that_wrote_into_its_folder_before_failing_keeps_it(tmp_path):
    with pytest.raises(RuntimeError, match="the model failed at its first step"):
        _fit(tmp_path, "--model=tests.test_cli_entry.CrashingDigits", "--data=null")
    assert (tmp_path / "lightning_logs" / "version_0" / "precision_report.md").is_file()


def test_a_sample_built_without_its_package_says_the_extra_in_one_line(monkeypatch):
    """The same line where the sample is built by other code than the CLI's check (jsonargparse, a user's script)."""
    from lightning_mp.cli.errors import missing_extra
    from lightning_mp.samples import ImageDataModule
    from lightning_mp.samples.resources import MissingExtraError

    monkeypatch.setitem(sys.modules, "sklearn", None)  # not installed, as importlib.util.find_spec sees it
    with pytest.raises(MissingExtraError) as refused:
        ImageDataModule(source="digits")
    assert missing_extra(refused.value) == str(refused.value)
    assert 'pip install "lightning_mp[samples]"' in str(refused.value)
    ImageDataModule(source="fashion_mnist")  # a source that does not need scikit-learn is not refused
