"""docs/options.md documents exactly the variables the runtime and the components declare, and
the log-level table.

The variables table is the merge of the runtime's declarations and every bundled component's
(:func:`ortmodule.options.variables`). Where a bundled component is not installed (a package's
own test session installs only what it needs) its rows are checked by the environments that have
it; every row of what is installed is checked here. Regenerate the generated blocks, with every
component installed (``nox -s dev``), after changing a declaration or ``LEVEL_POLICY``:
``python packages/ortmodule/tests/test_options_doc.py --write``
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from ortmodule.bundle import COMPONENT_VARIABLES
from ortmodule.log import LEVEL_POLICY, log_levels_markdown
from ortmodule.options import VARIABLES, variables_markdown

DOC = Path(__file__).resolve().parents[3] / "docs" / "options.md"
REGENERATE = "python packages/ortmodule/tests/test_options_doc.py --write"
BLOCKS = {"variables": variables_markdown, "log-levels": log_levels_markdown}
_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED: (?P<name>[\w-]+)[^>]*-->\n)(?P<body>.*?)(<!-- END GENERATED: (?P=name) -->)",
    re.S,
)


def _cells(row: str) -> list[str]:
    # split a markdown table row on unescaped pipes
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def _table(text: str, first_header: str) -> list[list[str]]:
    """Rows (as cells) of the markdown table whose first header cell is ``first_header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and _cells(line)[:1] == [first_header]:
            rows = []
            for row in lines[i + 2 :]:
                if not row.startswith("|"):
                    break
                rows.append(_cells(row))
            return rows
    raise AssertionError(f"{DOC} has no table with a {first_header!r} column")


def _absent() -> set[str]:
    """Variables of bundled components that are not installed here."""
    return set(COMPONENT_VARIABLES) - {var.name for var in VARIABLES}


def _without(block: str, names: set[str]) -> str:
    """``block`` without the table rows of ``names``."""
    return "".join(
        line
        for line in block.splitlines(keepends=True)
        if not any(line.startswith(f"| `{name}` |") for name in names)
    )


def _doc() -> str:
    assert DOC.is_file(), f"{DOC} is missing"
    return DOC.read_text()


def test_every_parsed_variable_is_documented_and_nothing_else() -> None:
    documented = [row[0].strip("`") for row in _table(_doc(), "Variable")]
    parsed = [var.name for var in VARIABLES]
    undocumented = sorted(set(parsed) - set(documented))
    unparsed = sorted(set(documented) - set(parsed) - _absent())
    assert not undocumented, f"parsed but not documented in {DOC}: {undocumented}; run {REGENERATE}"
    assert not unparsed, f"documented in {DOC} but not parsed by ortmodule.options: {unparsed}"
    assert len(documented) == len(set(documented)), "a variable is documented twice"


def test_documented_rows_match_the_table() -> None:
    rows = {row[0].strip("`"): row for row in _table(_doc(), "Variable")}
    for var in VARIABLES:
        name, type_, default, accepted, honoured_by, doc, example = rows[var.name]
        assert (type_, accepted, honoured_by, doc) == (
            var.type,
            var.accepted,
            var.honoured_by,
            var.doc,
        ), var.name
        assert default.strip("`") and example.startswith(f"`export {var.name}="), var.name


def test_every_variable_mentioned_in_prose_exists() -> None:
    known = {var.name for var in VARIABLES} | set(COMPONENT_VARIABLES)
    mentioned = set(re.findall(r"ORTMODULE_[A-Z0-9_]+", _doc()))
    # the doc names one typo on purpose, as the example of an unknown variable
    assert mentioned - known == {"ORTMODULE_CACHEDIR"}


def test_log_level_table_documents_every_level() -> None:
    rows = _table(_doc(), "Log level")
    assert [row[0].strip("`") for row in rows] == [
        level.name for level in sorted(LEVEL_POLICY, reverse=True)
    ]


def test_generated_blocks_are_current() -> None:
    text = _doc()
    found = {m.group("name"): m.group("body") for m in _BLOCK.finditer(text)}
    assert set(found) == set(BLOCKS), f"generated blocks in {DOC}: {sorted(found)}"
    for name, render in BLOCKS.items():
        # the rows of components not installed here are checked where they are
        current = _without(found[name], _absent())
        assert current == render(), f"the {name} block of {DOC} is stale; run {REGENERATE}"


def test_the_whole_table_where_every_component_is_installed() -> None:
    if _absent():
        pytest.skip(f"not installed here: {sorted(set(COMPONENT_VARIABLES[n] for n in _absent()))}")
    assert {var.name for var in VARIABLES} >= set(COMPONENT_VARIABLES)


def _regenerate(text: str) -> str:
    def fill(m: re.Match[str]) -> str:
        return m.group(1) + BLOCKS[m.group("name")]() + m.group(4)

    return _BLOCK.sub(fill, text)


if __name__ == "__main__":
    if "--write" in sys.argv:
        if _absent():
            sys.exit(f"install every component first (nox -s dev); missing: {sorted(_absent())}")
        DOC.write_text(_regenerate(_doc()))
        print(f"wrote {DOC}")
