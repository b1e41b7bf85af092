"""One module follows the user (issue "One place knows what the user changed"): no module of the library but
``lightning_mp/master/following.py`` compares the optimizer's param groups, their parameters or its state by identity.

Read from the source (``ast``): an ``is``/``is not`` comparison (not with ``None``) or a ``map(operator.is_, ...)``
pass whose operands name ``param_groups``, a ``state``, a group or groups, ``params`` or ``["params"]``. Gradients are
not the optimizer's groups or state (the flat masters compare the gradients the model shows with their own): an
operand that names a gradient is left out. Every cache asks :func:`~lightning_mp.master.following.seen` instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_mp"
FOLLOWING = PACKAGE / "master" / "following.py"
NAMES = re.compile(r"param_groups|\bstate\b|\[['\"]params['\"]\]|\bgroups?\b|\bparams\b")
IDENTITY = ("is_", "is_not", "operator.is_", "operator.is_not")


def identity_comparisons(source: str) -> list[tuple[int, str]]:
    """``(line, code)`` of each identity comparison in ``source`` whose operands name the optimizer's groups,
    parameters or state (module doc)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        sides: list[ast.expr] = []
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(side, ast.Constant) and side.value is None for side in sides):
                continue
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) == "map"
            and node.args
            and ast.unparse(node.args[0]) in IDENTITY
        ):
            sides = list(node.args[1:])
        texts = [ast.unparse(side) for side in sides]
        if texts and any(NAMES.search(text) for text in texts) and not any("grad" in text for text in texts):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_but_following_compares_the_optimizers_groups_params_or_state_by_identity():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {code}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != FOLLOWING
        for line, code in identity_comparisons(path.read_text())
    ]
    assert offenders == [], "ask lightning_mp.master.following.seen instead:\n" + "\n".join(offenders)


def test_the_check_sees_the_comparisons_it_forbids():
    """The checker itself, on the shapes of comparison the step used to make in seven files."""
    forbidden = [
        "state is not self.state",
        "all(map(is_, params, self.params))",
        "any(group is known for known in seen)",
        "optimizer.param_groups is not groups",
        "all(map(operator.is_, group['params'], known))",
    ]
    allowed = ["param is None", "grad is not shown_grad", "list(map(operator.is_, grads, shown))", "a is b"]
    assert all(identity_comparisons(code) for code in forbidden)
    assert not any(identity_comparisons(code) for code in allowed)
    assert identity_comparisons(FOLLOWING.read_text())  # the one module where they are
