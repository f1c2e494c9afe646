"""Runtime tests run with fallback disabled, so a PyTorch fallback can never hide a failure.
Tests of the fallback itself set ORTMODULE_FALLBACK_POLICY with monkeypatch."""

from __future__ import annotations

from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: Python source, run first in a subprocess, that makes ``ortmodule`` and ``ortmodule_exporter``
#: bare packages (their ``__init__`` not run) with this checkout's sources first, so a test sees
#: exactly what one module imports
BARE_PACKAGES = f"""
import importlib.util, sys, types
for name in ("ortmodule", "ortmodule_exporter"):
    spec = importlib.util.find_spec(name)
    pkg = types.ModuleType(name)
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules[name] = pkg
sys.path.insert(0, {str(SRC)!r})
sys.modules["ortmodule"].__path__.insert(0, {str(SRC / "ortmodule")!r})
"""


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
