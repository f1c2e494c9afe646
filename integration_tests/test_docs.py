"""Every ```python block in README.md, docs/*.md and docs/packages/*.md runs, so the docs cannot rot.

The blocks of one file run in order in one namespace (a page reads top to bottom, and later
blocks may use what earlier ones defined), in a temporary working directory, with the
environment restored afterwards. A block that cannot run here (CUDA, several processes) starts
with a comment naming why, ``# doctest: skip (needs CUDA)``, and a test checks that every
skipped block gives its reason. Links between the pages, and each package's page, are checked too.
"""

from __future__ import annotations

import os
import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md")), *sorted((DOCS / "packages").glob("*.md"))]
SKIP = re.compile(r"^#\s*doctest:\s*skip\b\s*(?:\((?P<reason>.*)\))?\s*$")
#: a block that shows the fallback itself runs under the default policy; every other block runs
#: with ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE (conftest), so no example passes in PyTorch
FALLBACK = re.compile(r"^#\s*doctest:\s*default fallback policy\b.*$")
FENCE = re.compile(r"^(?P<indent>\s*)```\s*(?P<lang>[\w+-]*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    #: None: the block runs; otherwise the text of its skip marker's reason ("" when missing)
    skip: str | None
    #: the block demonstrates the fallback: it runs under the default fallback policy
    fallback: bool = False

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` for every fenced code block of a Markdown file."""
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = len(opening.group("indent"))
        body = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            body.append(lines[j][indent:])
            j += 1
        found.append((i + 1, opening.group("lang").lower(), "\n".join(body) + "\n"))
        i = j + 1
    return found


def python_blocks(path: Path) -> list[Block]:
    blocks = []
    for line, lang, code in fenced_blocks(path):
        if lang not in ("python", "py"):
            continue
        first = code.lstrip("\n").splitlines()[0] if code.strip() else ""
        marker = SKIP.match(first.strip())
        skip = None if marker is None else (marker.group("reason") or "").strip()
        blocks.append(Block(path, line, code, skip, FALLBACK.match(first.strip()) is not None))
    return blocks


RUNNABLE = [p for p in PAGES if any(b.skip is None for b in python_blocks(p))]


def test_docs_examples_run_with_fallback_disabled() -> None:
    assert os.environ.get("ORTMODULE_FALLBACK_POLICY") == "FALLBACK_DISABLE"


def test_the_docs_have_runnable_examples() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in RUNNABLE}
    assert {"docs/user_guide.md", "docs/architecture.md"} <= names, names


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    saved_env = dict(os.environ)
    namespace: dict[str, object] = {"__name__": "docs_" + re.sub(r"\W", "_", page.stem)}
    try:
        for block in python_blocks(page):
            if block.skip is not None:
                continue
            code = compile(block.code, block.where, "exec")
            failure = None
            policy = os.environ.pop("ORTMODULE_FALLBACK_POLICY", None) if block.fallback else None
            try:
                exec(code, namespace)
            except Exception:
                failure = traceback.format_exc(limit=-6)
            finally:
                if policy is not None:
                    os.environ["ORTMODULE_FALLBACK_POLICY"] = policy
            if failure is not None:
                pytest.fail(f"the python block at {block.where} failed:\n{failure}", pytrace=False)
    finally:
        os.environ.clear()
        os.environ.update(saved_env)


def test_skipped_blocks_say_why() -> None:
    skipped = [b for p in PAGES for b in python_blocks(p) if b.skip is not None]
    missing = [b.where for b in skipped if not b.skip]
    assert not missing, (
        "a skipped block must name its reason on its first line, "
        f"like `# doctest: skip (needs CUDA)`: {missing}"
    )


def test_a_skip_marker_is_only_recognised_on_the_first_line() -> None:
    # a marker further down would silently not skip, or look like it does: keep it on line one
    late = [
        b.where
        for p in PAGES
        for b in python_blocks(p)
        if b.skip is None
        and any("doctest:" in line for line in b.code.strip().splitlines()[b.fallback :])
    ]
    assert not late, f"`# doctest:` markers must be on the block's first line: {late}"


def _packages() -> dict[str, Path]:
    import tomllib

    found = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        with open(pyproject, "rb") as f:
            found[tomllib.load(f)["project"]["name"]] = pyproject.parent
    return found


@pytest.mark.parametrize("dist", sorted(_packages()))
def test_every_package_has_a_page_that_links_its_readme(dist: str) -> None:
    page = DOCS / "packages" / f"{dist}.md"
    assert page.exists(), f"add docs/packages/{dist}.md (a short page linking the package README)"
    readme = f"../../packages/{_packages()[dist].name}/README.md"
    assert readme in page.read_text(encoding="utf-8"), f"{page.name} should link {readme}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        if in_code or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [m.group("target") for m in LINK.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_between_pages_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"
