"""Figures that cannot go stale: every memory and speed figure of the README and of the docs' front pages cites the
`benchmarks/RESULTS.md` row it comes from, and is found there.

How a figure cites its row (docs/benchmarks.md, "Figures and their rows", says the same for writers):

- RESULTS.md marks each table that a page cites with an anchor, `<a id="results-NAME"></a>`, before the table or before
  the heading of a section whose first table it is. The section around it names the command that produced it.
- A figure in prose is a link to that anchor whose title is the row's label (its first cell; `label; cell 2` when the
  first cell does not tell rows apart): `[0.81x](benchmarks/RESULTS.md#results-decoder-cpu "ours+remainder")`.
- A table of figures ends with a column headed `[RESULTS.md row](benchmarks/RESULTS.md#results-NAME)` that holds each
  row's label; a column whose header links to another anchor takes its figures from that table instead.

From docs/ the link goes to `benchmarks.md#results-NAME` (the page includes RESULTS.md). A figure is found when a
number of the cited row equals it to the figure's own precision (16 cites 16.06; 1,268 cites 1267.6). Updating a
figure is a change of RESULTS.md and the page together: a figure left behind fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
#: the pages whose figures must cite their rows: the README and the docs' front pages (the top of the benchmarks page,
#: down to where it includes RESULTS.md itself)
PAGES = {
    "README.md": (ROOT / "README.md").read_text(),
    "docs/index.md": (ROOT / "docs" / "index.md").read_text(),
    "docs/getting-started.md": (ROOT / "docs" / "getting-started.md").read_text(),
    "docs/benchmarks.md": (ROOT / "docs" / "benchmarks.md").read_text().split("\n## Lean masters: one-pass", 1)[0],
}
LINK = re.compile(r"\[([^\]]+)\]\((?:[./\w-]*)#(results-[\w-]+)(?: \"([^\"]+)\"| '([^']+)')?\)")
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?")
#: what a figure looks like in prose (a ratio, a size per parameter, a time, a memory, a throughput)
FIGURE = re.compile(r"\b\d[\d,]*(?:\.\d+)?(?:x\b| ?(?:bytes/param|ms\b|MiB|GiB|samples/s))")


def _cells(row: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _anchors() -> dict[str, tuple[list[list[str]], str]]:
    """``{anchor: (rows of the first table after it, the text of the section around it)}``."""
    lines = RESULTS.read_text().splitlines()
    found = {}
    for index, line in enumerate(lines):
        anchor = re.fullmatch(r'<a id="(results-[\w-]+)"></a>', line.strip())
        if anchor is None:
            continue
        after = next(i for i in range(index + 1, len(lines)) if lines[i].strip())
        # the section: the one the anchor heads, or the one it stands in
        start = (
            after if lines[after].startswith("#") else next(i for i in range(index, -1, -1) if lines[i].startswith("#"))
        )
        first = next((i for i in range(index + 1, len(lines)) if lines[i].startswith("|")), None)
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("#")), len(lines))
        assert first is not None and first < next(
            (i for i in range(index + 1, len(lines)) if lines[i].startswith("<a id=")), len(lines)
        ), f"{anchor.group(1)}: no table after it"
        table = []
        for row in lines[first:]:
            if not row.startswith("|"):
                break
            table.append(_cells(row))
        found[anchor.group(1)] = (table[2:], "\n".join(lines[start:end]))  # header and separator dropped
    return found


ANCHORS = _anchors()


def _plain(label: str) -> str:
    return " ".join(label.replace("\\|", "|").split())


def _row(anchor: str, label: str) -> list[str]:
    """The row of ``anchor``'s table whose first cells are ``label`` (``cell 1; cell 2``), exactly one."""
    assert anchor in ANCHORS, f"#{anchor} is not an anchor of RESULTS.md (it has {sorted(ANCHORS)})"
    wanted = [_plain(part) for part in label.split("; ")]
    rows = [row for row in ANCHORS[anchor][0] if [_plain(cell) for cell in row[: len(wanted)]] == wanted]
    assert len(rows) == 1, f"#{anchor}: {len(rows)} rows are labelled {label!r} (give more cells: 'label; cell 2')"
    return rows[0]


def _found(figure: str, rows: list[list[str]]) -> bool:
    """Whether ``figure`` (a number as written) is a number of ``rows`` to its own precision."""
    decimals = len(figure.partition(".")[2])
    value = float(figure.replace(",", ""))
    numbers = [float(n.replace(",", "")) for row in rows for cell in row for n in NUMBER.findall(cell)]
    return any(abs(number - value) <= 0.5 * 10**-decimals + 1e-12 for number in numbers)


def _outside_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _citations() -> list[tuple[str, str, list[str], list[list[str]]]]:
    """``(page, where, figures, cited rows)`` for every cited figure of every page."""
    found = []
    for page, text in PAGES.items():
        lines = _outside_code(text).splitlines()
        for line in lines:
            for figure, anchor, *titles in LINK.findall(line):
                label = "".join(titles)
                if not label and line.startswith("|"):
                    continue  # a table's header: its rows are read below
                assert label, f"{page}: [{figure}](#{anchor}) names no row: add its label as the link's title"
                found.append((page, line.strip()[:80], NUMBER.findall(figure), [_row(anchor, label)]))
        for header_at, header in enumerate(lines):
            cells = _cells(header) if header.startswith("|") else []
            if not cells or not cells[-1].startswith("[RESULTS.md row]"):
                continue
            default = LINK.search(cells[-1]).group(2)  # the table's anchor; a column's own header link wins
            anchors = [(LINK.search(cell).group(2) if LINK.search(cell) else default) for cell in cells]
            for row_line in lines[header_at + 2 :]:
                if not row_line.startswith("|"):
                    break
                row = _cells(row_line)
                for column, cell in enumerate(row[1:-1], start=1):
                    figures = NUMBER.findall(re.sub(r"`[^`]*`", "", cell))
                    if figures:
                        found.append((page, f"{row[0]} | {cells[column]}", figures, [_row(anchors[column], row[-1])]))
    return found


CITATIONS = _citations()


def test_every_cited_figure_is_in_the_results_row_it_cites():
    stale = [
        f"{page}: {where}: {figure} is not in {rows}"
        for page, where, figures, rows in CITATIONS
        for figure in figures
        if not _found(figure, rows)
    ]
    assert not stale, "\n".join(stale)


def test_each_cited_table_names_the_command_that_produced_it():
    cited = {match[1] for text in PAGES.values() for match in LINK.findall(text)}
    assert cited, "no page cites RESULTS.md"
    for anchor in sorted(cited):
        section = ANCHORS[anchor][1]
        assert re.search(r"python benchmarks/\w+\.py|benchmarks/\w+\.sh", section), f"#{anchor}: no command"


@pytest.mark.parametrize("page", sorted(PAGES))
def test_every_memory_and_speed_figure_of_the_front_pages_cites_its_row(page):
    """A figure in prose outside a citation link, or a table of figures without its ``RESULTS.md row`` column."""
    text = _outside_code(PAGES[page])
    uncited = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("|"):
            header = next(lines[i] for i in range(index, -1, -1) if not lines[i - 1].startswith("|") or i == 0)
            if "[RESULTS.md row]" not in header:
                uncited += [match.group(0) for match in FIGURE.finditer(LINK.sub("", re.sub(r"`[^`]*`", "", line)))]
            continue
        bare = LINK.sub("", re.sub(r"`[^`]*`", "", line))
        uncited += [match.group(0) for match in FIGURE.finditer(bare)]
    assert not uncited, f"{page}: figures that cite no RESULTS.md row: {uncited}"


def test_a_stale_figure_fails_the_check():
    """The check itself: a figure one digit off its row, or a row label that names no row, is refused."""
    rows = [_row("results-decoder-in-backward-cpu", "ours+remainder")]
    assert _found("0.81x".rstrip("x"), rows) and _found("14", rows)
    assert not _found("0.82", rows) and not _found("15.6", rows)
    with pytest.raises(AssertionError, match="rows are labelled"):
        _row("results-host-work", "ours bf16, fused")  # 197 and 797 tensors: 'ours bf16, fused; 197' says which
    assert _row("results-host-work", "ours bf16, fused; 197")[3] == "6"
