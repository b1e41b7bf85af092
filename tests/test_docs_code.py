"""Every Python code block of README.md and docs/*.md runs here: one test per block, named ``page:line``.

A block runs in a fresh namespace that holds the stand-ins of ``tests/docs_standins.py`` (``model``,
``datamodule``, ``batch``, ``x``, ``optimizer``: a tiny classifier on random data), inside a temporary working
directory, with every ``lightning.Trainer`` it builds capped at a few quiet steps (``TRAINER_DEFAULTS``: a block's
own arguments win). An HTML comment on the line before a block (invisible on GitHub and on the site) changes that:

- ``<!-- docs-test: skip REASON -->``: the block is collected and reported as skipped with REASON (a block that
  needs a GPU or several processes; the reason names the test that covers it);
- ``<!-- docs-test: continue -->``: the block runs after the page's previous Python block, in its namespace;
- ``<!-- docs-test: raises NAME -->``: the block must raise the exception class NAME (a builtin).

Other languages (bash, yaml, text) are not run; ``tests/test_readme.py`` checks the README's set-up commands.
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import pytest

from tests.docs_standins import TRAINER_DEFAULTS, standins

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PYTHON = ("python", "py", "python3")
_FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>skip|continue|raises)\b\s*(?P<arg>.*?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    directive: tuple[str, str] | None = None
    chain: list[Block] = field(default_factory=list)  # blocks to run first (``continue``)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT).as_posix()}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """Every fenced code block of ``page`` (any language), with the directive on the line before it."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opened = _FENCE_OPEN.match(lines[index])
        if opened is None:
            index += 1
            continue
        indent, fence = opened["indent"], opened["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = index + 1
        while end < len(lines) and not close.match(lines[end]):
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[index + 1 : end]]
        before = next((lines[i] for i in range(index - 1, -1, -1) if lines[i].strip()), "")
        found = _DIRECTIVE.match(before)
        info = opened["info"].strip()
        blocks.append(
            Block(
                page=page,
                line=index + 1,
                lang=info.split()[0].lower() if info else "",
                # blank lines first, so that tracebacks show the page's own line numbers
                source="\n" * (index + 1) + "\n".join(body) + "\n",
                directive=(found["kind"], found["arg"]) if found else None,
            )
        )
        index = end + 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    blocks = [block for block in code_blocks(page) if block.lang in PYTHON]
    for previous, block in zip([None, *blocks], blocks):
        if block.directive and block.directive[0] == "continue":
            assert previous is not None, f"{block.name}: 'continue' needs a Python block before it on the page"
            block.chain = [*previous.chain, previous]
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in python_blocks(page)]


def _param(block: Block) -> pytest.param:
    skipped = [b for b in (*block.chain, block) if b.directive and b.directive[0] == "skip"]
    marks = [pytest.mark.skip(reason=f"{skipped[-1].name}: {skipped[-1].directive[1]}")] if skipped else []
    return pytest.param(block, id=block.name, marks=marks)


@pytest.fixture
def docs_sandbox(tmp_path, monkeypatch):
    """A temporary working directory, and Trainers capped at a few quiet steps that write inside it."""
    monkeypatch.chdir(tmp_path)
    original_init = L.Trainer.__init__

    def capped_init(self, *args, **kwargs):
        for key, value in {**TRAINER_DEFAULTS, "default_root_dir": str(tmp_path)}.items():
            kwargs.setdefault(key, value)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "__init__", capped_init)
    return tmp_path


@pytest.mark.filterwarnings("ignore::UserWarning")  # fp16 on CPU, tiny data loaders: what the blocks show is run
@pytest.mark.parametrize("block", [_param(block) for block in ALL_BLOCKS])
def test_docs_code_block_runs(block: Block, docs_sandbox):
    namespace = {"__name__": "__docs__", **standins()}
    for earlier in block.chain:
        exec(compile(earlier.source, str(earlier.page), "exec"), namespace)
    code = compile(block.source, str(block.page), "exec")
    if block.directive and block.directive[0] == "raises":
        with pytest.raises(getattr(builtins, block.directive[1])):
            exec(code, namespace)
    else:
        exec(code, namespace)


def test_every_python_fence_of_the_docs_is_collected():
    # an independent count of opening fences, so that a fence the parser misreads cannot drop out silently
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = re.findall(r"^[ \t]*(?:```|~~~)[ \t]*(?:python3?|py)\b", text, flags=re.MULTILINE | re.IGNORECASE)
        assert len(fences) == len(python_blocks(page)), page


def test_every_directive_is_attached_to_a_python_block():
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        directive_lines = {i + 1 for i, line in enumerate(lines) if "docs-test:" in line}
        attached = set()
        for block in python_blocks(page):
            if block.directive:
                attached.add(next(i for i in range(block.line - 1, 0, -1) if lines[i - 1].strip()))
        assert directive_lines == attached, f"{page}: a docs-test directive not right before a Python block"
        for block in python_blocks(page):
            if block.directive and block.directive[0] in ("skip", "raises"):
                assert block.directive[1], f"{block.name}: '{block.directive[0]}' needs a reason / exception name"


def test_the_parser_reads_directives_chains_and_indented_fences(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n```python\na = 1\n```\n\n<!-- docs-test: continue -->\n```python\nb = a + 1\n```\n\n"
        "- a list item:\n\n    ```py\n    if True:\n        c = 3\n    ```\n\n"
        "<!-- docs-test: skip needs a GPU -->\n```python\nimport cuda_only\n```\n\n```bash\nls\n```\n"
    )
    first, second, third, fourth = python_blocks(page)
    assert [b.line for b in (first, second, third, fourth)] == [3, 8, 14, 20]
    assert second.chain == [first] and second.directive == ("continue", "")
    assert fourth.directive == ("skip", "needs a GPU")
    namespace: dict = {}
    exec(compile(third.source, "page.md", "exec"), namespace)
    assert namespace["c"] == 3
    assert [b.lang for b in code_blocks(page)] == ["python", "python", "py", "python", "bash"]
