"""docs/operators.md is generated from the OpInfo data file and must not go stale.

Regenerate after changing ``opinfo_status.json``: ``python tools/operators_doc.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _tool() -> object:
    spec = importlib.util.spec_from_file_location(
        "operators_doc", ROOT / "tools" / "operators_doc.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_operators_page_matches_the_data_file() -> None:
    tool = _tool()
    expected = tool.render(json.loads(tool.DATA.read_text()))  # type: ignore[attr-defined]
    assert tool.DOC.read_text() == expected, (
        "docs/operators.md is stale: python tools/operators_doc.py"
    )  # type: ignore[attr-defined]


def test_every_unsupported_op_says_why() -> None:
    ops = json.loads((Path(__file__).parent / "opinfo_status.json").read_text())["ops"]
    for name, entry in ops.items():
        assert entry["status"] in ("native", "aten", "unsupported", "skip"), name
        if entry["status"] in ("unsupported", "skip"):
            assert entry.get("reason", "").strip(), f"{name} is {entry['status']} with no reason"
