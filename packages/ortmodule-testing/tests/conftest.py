"""Shared settings for the zoo's own tests."""

from __future__ import annotations

import pytest
import torch

# The models are tiny and CI machines are small and shared: one intra-op thread is faster than
# several threads spinning against each other, and it costs less CPU.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that runs ORTModule must never pass on a PyTorch fallback (tests of the fallback
    itself set ORTMODULE_FALLBACK_POLICY with monkeypatch)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
