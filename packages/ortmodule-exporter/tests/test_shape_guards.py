"""Shape guards evaluated on numpy: a step that reads a dim shape inference left unknown fails."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch

sg = importlib.import_module("ortmodule_exporter.export.shape_guards")
guards = importlib.import_module("ortmodule_exporter.export.guards")


def _guard(compare: str) -> object:
    """``x.shape[1] <compare> 1`` where inference knew dim 0 of ``x`` (the input's) only."""
    steps = (
        sg._Step("Shape", ("x",), "s", ()),
        sg._Step("Constant", (), "i", (("value", np.array(1)),)),
        sg._Step("Gather", ("s", "i"), "n", ()),
        sg._Step("Constant", (), "one", (("value", np.array(1)),)),
        sg._Step(compare, ("n", "one"), "out", ()),
    )
    traced = guards.Guard("bool", torch.tensor(False), "model.py:1: if x.shape[1] == 1:")
    return sg.ShapeGuard(traced, steps, "out", (("x", (sg.Dim("input", 0), None)),))


@pytest.mark.parametrize("compare", ["Equal", "Greater", "Less", "Sub"])
def test_a_comparison_of_an_unknown_dim_fails_instead_of_giving_false(compare: str) -> None:
    # numpy's None == 1 is False: the guard held on the traced shapes, read no input dim, and
    # was dropped as a constant (a later call with x.shape[1] == 1 kept the graph traced for
    # another length)
    guard = _guard(compare)
    with pytest.raises(ValueError, match="unknown"):
        guard.value(lambda name: (4, 7))


def test_a_known_dim_is_compared() -> None:
    guard = sg.ShapeGuard(
        guards.Guard("bool", torch.tensor(False), "model.py:1"),
        _guard("Equal").steps,  # type: ignore[attr-defined]
        "out",
        (("x", (sg.Dim("input", 0), sg.Dim("input", 1))),),
    )
    assert not guard.holds(lambda name: (4, 1))
    assert guard.holds(lambda name: (4, 7))
