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
    "TensorSubclassCheckpointIO",
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


def _part(module: str) -> str:
    """The package (or top-level module) of the library ``module`` belongs to: ``lightning_mp.diagnostics``,
    ``lightning_mp.plugin``."""
    return ".".join(module.split(".")[:2])


def test_no_two_packages_import_each_other_even_lazily_or_for_type_checking():
    """Between two packages (or top-level modules) the imports go one way: every import counts, in functions and
    under TYPE_CHECKING (diagnostics <-> plugin through type-only imports, callbacks <-> plugin and fp8 <-> policy
    were such pairs until issue 52)."""
    uses: dict[tuple[str, str], list[str]] = {}
    for name, path in MODULES.items():
        for target in _imports(path, module_level_only=False):
            if _part(name) != _part(target):
                uses.setdefault((_part(name), _part(target)), []).append(f"{name} -> {target}")
    both = {pair: (found, uses[pair[::-1]]) for pair, found in uses.items() if pair < pair[::-1] and pair[::-1] in uses}
    assert not both, both


def test_the_diagnostics_never_import_the_plugin():
    """The diagnostics get what they need of a skipped step as a value (``diagnostics/skipped.py``), never the
    plugin's class, not even for type checking."""
    found = {
        name: sorted(m for m in _imports(path, module_level_only=False) if _part(m) == "lightning_mp.plugin")
        for name, path in MODULES.items()
        if name.startswith("lightning_mp.diagnostics")
    }
    assert {name: targets for name, targets in found.items() if targets} == {}


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


def _modules_after(*statements: str) -> list[set[str]]:
    """For each statement, the modules ``sys.modules`` holds after it runs in a fresh interpreter (the interpreters
    run at the same time: each spends its seconds importing on one core)."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for statement in statements
    ]
    found = []
    for statement, process in zip(statements, processes):
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, (statement, err[-3000:])
        found.append(set(json.loads(out)))
    return found


def test_import_lightning_mp_loads_neither_cli_nor_samples_nor_their_dependencies():
    # torchmetrics (a core dependency, imported by lightning) itself imports transformers when it is installed:
    # what counts is that lightning_mp adds no sample-only dependency beyond what lightning already loads (baseline)
    loaded, baseline = _modules_after("import lightning_mp", "import lightning.pytorch, torchmetrics")
    assert not {m for m in loaded if m.startswith(APPLICATIONS)}
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


# ---------------------------------------------------------------------------------------------- private attributes
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign_names() -> set[str]:
    """Attribute names torch's and Lightning's objects have (``module._buffers``, ``tensor._values``, a
    LightningModule's ``_fabric``): a read of one is a read of their API, even where one of our classes also names an
    attribute so."""
    import lightning.fabric as lf
    import lightning.pytorch as pl
    import torch

    objects = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, pl.Trainer, pl.LightningModule, pl.Callback)
    names = {name for obj in (*objects, lf.Fabric) for name in dir(obj)}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    return names | set(vars(torch.nn.Module())) | set(vars(optimizer)) | set(vars(pl.LightningModule()))


def _private_definitions() -> dict[str, set[str]]:
    """``_name -> the modules defining it``: methods and attributes of a class body, and ``self._name = ...``."""
    defined: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.append(statement.name)
                    elif isinstance(statement, ast.Assign):
                        names += [target.id for target in statement.targets if isinstance(target, ast.Name)]
                    elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                        names.append(statement.target.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                names.append(node.attr)
            for name in filter(_private, names):
                defined.setdefault(name, set()).add(module)
    return defined


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private_reads(tree: ast.AST):
    """``(line, _name)`` of every ``x._name`` (read or written) and ``getattr/setattr/hasattr(x, "_name")`` where
    ``x`` is not ``self``, ``cls`` or ``super()``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            is_super = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super"
            if not _is_self(node.value) and not is_super:
                yield node.lineno, node.attr
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "setattr", "hasattr", "delattr"):
            name = node.args[1].value if len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) else None
            if isinstance(name, str) and _private(name) and not _is_self(node.args[0]):
                yield node.lineno, name


def _cross_module_private_reads() -> tuple[dict[str, set[str]], set[str]]:
    """``module -> the private names of our own classes it reads on another module's objects``, and the private
    names of torch's and Lightning's objects read anywhere. A name defined in the reading module and in another too
    counts as a cross-module read: the reader cannot tell whose it reads."""
    defined, foreign = _private_definitions(), _foreign_names()
    ours: dict[str, set[str]] = {}
    theirs: set[str] = set()
    for module, path in MODULES.items():
        for _, name in _private_reads(ast.parse(path.read_text())):
            if name in defined and name not in foreign:
                if defined[name] != {module}:
                    ours.setdefault(module, set()).add(name)
            else:
                theirs.add(name)
    return ours, theirs


#: Private API of torch, Lightning and torchao the library reads on purpose (each read where its public API has no
#: equivalent); a new one is added here knowingly.
TORCH_AND_LIGHTNING_PRIVATE_API = {
    *("_C", "_NormBase", "_amp_foreach_non_finite_check_and_unscale_", "_call_impl", "_current_autograd_node"),
    *("_current_graph_task_id", "_set_grad_enabled", "_getframe", "_version", "_values", "_data", "_tensor"),
    *("_foreach_add_", "_foreach_clamp_max_", "_foreach_clamp_min_", "_foreach_copy_", "_foreach_mul_"),
    *("_foreach_norm", "_foreach_sub_", "_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_execution_engine"),
    *("_buffers", "_parameters", "_post_accumulate_grad_hooks", "_register_state_dict_hook", "_opt_called"),
    *("_step_supports_amp_scaling", "_optimizer", "_local_tensor", "_get_fsdp_state", "_fsdp_param_group"),
    *("_fsdp_param_groups", "_init_mp_dtypes", "_orig_dtype", "_sharded_param_data", "_unsharded_param"),
    *("_trainer", "_fabric", "_strategy", "_precision", "_forward_module", "_original_module", "_logger_connector"),
    *("_call_lightning_module_hook", "_ddp_comm_hook", "_module_parameters", "_save_distributed_checkpoint"),
    *("_average_model", "_copy_state_dict", "_in_fabric_backward", "_set_optimizer_in_backward"),
    # master/flat_moves.py: whether code still holds the masters' gradient buffer (torch counts its users only here)
    *("_storage_Use_Count", "_cdata"),
    # master/lean/eightbit.py: torchao's own maker of an 8-bit optimizer's state (its layout stays torchao's), and
    # the cache limit torchao's step lifts around its compiled per-parameter step
    *("_new_buffer", "_dynamo"),
}


def test_no_module_reads_another_modules_private_attributes():
    """A module reaches another's objects through their public members: no ``x._name`` (nor ``getattr(x,
    "_name")``) on an object whose class is ours and defined in another module. Names also found on torch's or
    Lightning's objects are theirs (``module._buffers``), listed below."""
    ours, _ = _cross_module_private_reads()
    assert not ours, f"private attributes read across modules: {ours}"


def test_private_api_of_torch_and_lightning_is_read_only_where_listed():
    _, theirs = _cross_module_private_reads()
    assert theirs <= TORCH_AND_LIGHTNING_PRIVATE_API, sorted(theirs - TORCH_AND_LIGHTNING_PRIVATE_API)


def test_the_plugins_protocols_name_members_the_plugin_has_with_their_signatures():
    """Where the plugin's own class would be an import cycle, its parts take a Protocol naming what they use of it:
    each member is the plugin's, a method with the plugin's parameters, so the Protocol cannot drift from it. The same
    for the policy the fp8 part reads (``Fp8Rules``: ``CastPolicy`` asks the fp8 part, so the fp8 part names it)."""
    import inspect

    from typing_extensions import get_protocol_members

    from lightning_mp import CastPolicy, MixedPrecisionPlugin
    from lightning_mp.diagnostics.skipped import SkipSource
    from lightning_mp.distributed.sync import PluginDtypes, StrategyPlugin
    from lightning_mp.fabric.driver import DrivenPlugin
    from lightning_mp.fp8.convert import PolicySource
    from lightning_mp.fp8.layers import Fp8Rules

    plugin = MixedPrecisionPlugin("bf16-mixed", master_weights="remainder")
    for protocol, offered in (
        *((protocol, plugin) for protocol in (PluginDtypes, StrategyPlugin, DrivenPlugin, PolicySource, SkipSource)),
        (Fp8Rules, CastPolicy()),
    ):
        for name in sorted(get_protocol_members(protocol)):
            assert hasattr(offered, name), (protocol.__name__, name)
            wanted = getattr(protocol, name, None)
            if inspect.isfunction(wanted):  # the Protocol's function takes self; the offered member is bound
                have = inspect.signature(getattr(offered, name)).parameters
                assert list(inspect.signature(wanted).parameters)[1:] == list(have), (protocol.__name__, name)


def test_no_module_imports_another_modules_private_names():
    """``from lightning_mp.x import _name`` is a read of another module's private attribute too."""
    found: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lightning_mp")):
                found.setdefault(module, set()).update(a.name for a in node.names if _private(a.name))
    found = {module: names for module, names in found.items() if names}
    assert not found, found


def test_the_plugin_is_never_typed_any():
    """The parts handed the plugin name it: its class, ``object`` where they only pass it on, or a Protocol of what
    they use where its class would be an import cycle."""
    found = {name: path.read_text().count("plugin: Any") for name, path in MODULES.items()}
    assert {name: count for name, count in found.items() if count} == {}
