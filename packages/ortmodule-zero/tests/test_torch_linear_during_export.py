"""While ORTModule exports, PyTorch's own linear is in place even after ZeRO-3 replaced it."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from ortmodule_zero.stage3 import _torch_linear


def test_deepspeeds_process_wide_linear_is_swapped_out_only_during_export(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    original = torch.nn.functional.linear

    def zero3_linear_wrap(*args: object) -> object:  # stands in for DeepSpeed's replacement
        raise AssertionError("DeepSpeed's linear must not be traced by the export")

    zero3_linear_wrap.__module__ = "deepspeed.runtime.zero.linear"
    holder = types.SimpleNamespace(linear_bk=original)
    monkeypatch.setitem(
        sys.modules,
        "deepspeed.runtime.zero.partition_parameters",
        types.SimpleNamespace(InsertPostInitMethodToModuleSubClasses=holder),
    )
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    with _torch_linear():
        assert torch.nn.functional.linear is original
        torch.nn.Linear(3, 2)(torch.randn(1, 3))
    assert torch.nn.functional.linear is zero3_linear_wrap


def test_an_unpatched_linear_is_left_alone() -> None:
    before = torch.nn.functional.linear
    with _torch_linear():
        assert torch.nn.functional.linear is before
    assert torch.nn.functional.linear is before
