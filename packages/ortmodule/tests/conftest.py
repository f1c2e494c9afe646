"""Runtime tests run with fallback disabled, so a PyTorch fallback can never hide a failure.
Tests of the fallback itself set ORTMODULE_FALLBACK_POLICY with monkeypatch."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
