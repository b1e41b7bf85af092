"""The layout constraints of DESIGN.md and docs/architecture.md, stated as a test.

Library at the top of ``lightning_mp/`` (at most 10 modules there), the applications of it in ``cli/`` and
``samples/``; no module over 600 lines (the guide's flag for one concept per module); no module-level import cycle; the dependency arrows point one way;
``import lightning_mp`` loads neither the CLI nor the samples; the public API is unchanged.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_mp"
PUBLIC_NAMES = [
    "CastPolicy",
    "Census",
    "DynamicLossScaler",
    "MasterWeights",
    "MixedPrecisionPlugin",
    "PrecisionMonitor",
    "audit",
]
APPLICATIONS = ("lightning_mp.cli", "lightning_mp.samples")
NUMERICS = (
    "lightning_mp.scaler",
    "lightning_mp.grads",
    "lightning_mp.kernels",
    "lightning_mp.master",
    "lightning_mp.policy",
    "lightning_mp.stepping",
    "lightning_mp.schedulers",
)
# the floor: what both the scaler and the weights build on, importing nothing of the library above it
FLOOR = {"lightning_mp.grads": ("lightning_mp.kernels",), "lightning_mp.kernels": ("lightning_mp.kernels",)}
# the modules of one optimizer step: the plugin hands the step to stepping, which owns its order and calls the scaler
STEP_MODULES = (
    "lightning_mp.plugin",
    "lightning_mp.stepping",
    "lightning_mp.scaler",
    "lightning_mp.scaler.loss_scaler",
    "lightning_mp.scaler.rules",
    "lightning_mp.scaler.device",
    "lightning_mp.scaler.settings",
    "lightning_mp.grads",
    "lightning_mp.schedulers",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, module_level_only: bool) -> set[str]:
    """The lightning_mp modules ``path`` imports (``from X import y`` counts as X.y when that is a module)."""
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    nodes = list(_module_level(tree.body)) if module_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES}


def _module_level(statements: list[ast.stmt]):
    """Import statements that run when the module is imported: not in functions, not under TYPE_CHECKING."""
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _module_level(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _module_level(child.body if isinstance(child, ast.ExceptHandler) else [child])


def test_library_at_the_top_has_at_most_ten_modules():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top
    assert {"cli", "samples", "master", "distributed", "diagnostics"} <= {
        p.name for p in PACKAGE.iterdir() if p.is_dir()
    }


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_600_lines(name):
    """One concept per module: past ~600 lines a module is likely two (the developers' guide's flag). A concept is
    never cut to fit a count: a module that grows past it is split where a concept ends."""
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= 600, f"{MODULES[name].relative_to(ROOT)} has {lines} lines"


@pytest.mark.parametrize("module_level_only", [True, False], ids=["module-level", "every-import"])
def test_no_import_cycle(module_level_only):
    """No cycle among the package's modules: at module level (an import-time cycle), and none either counting the
    imports made inside functions or for type checking (fabric/driver -> plugin -> fabric/hooks, fp8/layers <->
    policy and diagnostics/monitor <-> run_report were such cycles until issue 29)."""
    graph = {name: _imports(path, module_level_only=module_level_only) - {name} for name, path in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_step_modules_import_one_way_even_lazily_or_for_type_checking():
    # every import counts here (in functions, under TYPE_CHECKING): plugin -> stepping -> scaler -> its device side
    graph = {
        name: _imports(MODULES[name], module_level_only=False) & set(STEP_MODULES) - {name} for name in STEP_MODULES
    }
    assert "lightning_mp.stepping" in graph["lightning_mp.plugin"]
    assert "lightning_mp.scaler" in graph["lightning_mp.stepping"]
    for arithmetic in STEP_MODULES[2:]:
        assert not graph[arithmetic] & {"lightning_mp.stepping", "lightning_mp.plugin"}, (arithmetic, graph[arithmetic])
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        for target in sorted(graph[name]):
            assert target not in path, "import cycle: " + " -> ".join(path[path.index(target) :] + [target])
            if target not in done:
                visit(target, path + [target])
        done.add(name)

    for name in STEP_MODULES:
        visit(name, [name])


def test_dependency_arrows_point_one_way():
    for name, path in MODULES.items():
        imported = _imports(path, module_level_only=False)
        if (
            not name.startswith(APPLICATIONS) and name != "lightning_mp.__main__"
        ):  # the library never imports its applications, not even lazily
            assert not {m for m in imported if m.startswith(APPLICATIONS)}, (name, imported)
        if name.startswith("lightning_mp.samples"):  # samples know nothing of the CLI
            assert not {m for m in imported if m.startswith("lightning_mp.cli")}, (name, imported)
        if name.startswith(NUMERICS):  # numerics are observed by diagnostics and glued by the plugin, never the reverse
            banned = ("lightning_mp.diagnostics", "lightning_mp.plugin", "lightning_mp.distributed")
            assert not {m for m in imported if m.startswith(banned)}, (name, imported)


def test_the_floor_imports_nothing_above_it():
    """``grads`` (the gradients a step checks) and ``kernels/`` sit below both the scaler and the weights: they import
    nothing of the library but the floor below them, not even lazily or for type checking (``master`` importing the
    scaler through the check was a back-arrow until issue 45)."""
    for name, path in MODULES.items():
        for floor, allowed in FLOOR.items():
            if name == floor or name.startswith(floor + "."):
                imported = _imports(path, module_level_only=False) - {name}
                assert all(module.startswith(allowed) for module in imported), (name, imported)
    assert "lightning_mp.grads" in _imports(MODULES["lightning_mp.master.in_backward.flags"], module_level_only=False)


def test_no_module_reaches_into_the_scaler_or_the_monitor():
    """The scaler's counters are its own (``scaler/device.py`` takes and returns its state: ``scaler_device.py`` read
    and wrote them 16 times, the repr once) and so are ``PrecisionMonitor``'s fields (the Fabric monitor read them 11
    times): no module names a private attribute through a ``scaler`` or ``monitor``, nor imports the monitor module's
    private names (issue 45)."""
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = node.value
                last = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if last in ("scaler", "monitor"):
                    found.append(f"{name}:{node.lineno}: {last}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "lightning_mp.diagnostics.monitor":
                found += [f"{name}:{node.lineno}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert not found, found


def _modules_after(statement: str) -> set[str]:
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return set(json.loads(out.stdout))


def test_import_lightning_mp_loads_neither_cli_nor_samples_nor_their_dependencies():
    loaded = _modules_after("import lightning_mp")
    assert not {m for m in loaded if m.startswith(APPLICATIONS)}
    # torchmetrics (a core dependency, imported by lightning) itself imports transformers when it is installed:
    # what counts is that lightning_mp adds no sample-only dependency beyond what lightning already loads
    baseline = _modules_after("import lightning.pytorch, torchmetrics")
    added = loaded - baseline
    assert not {m for m in added if m.split(".")[0] in ("transformers", "sklearn", "matplotlib", "torchao")}, added
    # the standalone Lightning packages only through lightning_mp.pytorch_lightning / lightning_mp.lightning_fabric
    assert not {m for m in loaded if m.split(".")[0] in ("pytorch_lightning", "lightning_fabric")}


def test_public_api_is_unchanged():
    import lightning_mp

    assert sorted(lightning_mp.__all__) == sorted(PUBLIC_NAMES)
    for name in PUBLIC_NAMES:
        assert getattr(lightning_mp, name) is not None


def test_sample_classes_keep_short_names_in_configs():
    from lightning_mp.samples import BertClassifier, ImageDataModule, ResNetClassifier, SentimentDataModule

    assert BertClassifier.__module__ == "lightning_mp.samples.models.bert"
    assert ResNetClassifier.__module__ == "lightning_mp.samples.models.resnet"
    assert SentimentDataModule.__module__ == "lightning_mp.samples.data.sentiment"
    assert ImageDataModule.__module__ == "lightning_mp.samples.data.images"
    configs = {path.name: path.read_text() for path in (ROOT / "configs").glob("*.yaml")}
    assert any("class_path: BertClassifier" in text for text in configs.values())
    assert all("lightning_mp.models" not in text and "lightning_mp.data" not in text for text in configs.values())


def test_library_code_carries_no_dates():
    """Docstrings say why; measurements and the dates they were taken live in benchmarks/RESULTS.md, HISTORY.md and
    the CHANGELOG, where they can be kept current (a dated figure in a docstring goes stale unseen)."""
    import re

    dated = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in MODULES.values()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b20\d\d-\d\d-\d\d\b", line)
    ]
    assert not dated, dated
