"""Integration tests run with fallback disabled: each claims the engine did the work."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that runs ORTModule must never pass on a PyTorch fallback (tests of the fallback
    itself set ORTMODULE_FALLBACK_POLICY with monkeypatch)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
