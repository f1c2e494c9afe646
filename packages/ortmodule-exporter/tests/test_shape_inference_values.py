"""torch.onnx's whole-graph shape inference sees no large weight's value during our export."""

from __future__ import annotations

import importlib
import io
from typing import Any

import pytest
import torch
from conftest import assert_engine_matches_eager

from ortmodule_exporter import export
from ortmodule_exporter.torchscript_onnx import export_utils

values = importlib.import_module("ortmodule_exporter.export.shape_inference_values")

_PASS = "_jit_pass_onnx_graph_shape_type_inference"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # 300 x 300 = 90,000 elements: above the limit; the biases (300, 4) below it
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))


def _recording(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int]]:
    """Record the sizes of the values each whole-graph inference is handed."""
    seen: list[dict[str, int]] = []
    binding = export_utils._C
    inner = getattr(binding, _PASS)

    def record(graph: Any, params: Any, *rest: Any) -> Any:
        seen.append({name: int(v.numel()) for name, v in params.items()})
        return inner(graph, params, *rest)

    monkeypatch.setattr(binding, _PASS, record)
    return seen


def test_the_export_hides_large_values_from_whole_graph_shape_inference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each pass copied every value a node reads into a one-node ONNX model: on GPT-2 small
    # the 124M parameters, twice, seconds of the export, for types the values do not decide
    seen = _recording(monkeypatch)
    model = _model()
    x = torch.randn(5, 300)
    exported = export(model, (x,), training=True)
    assert seen, "torch.onnx ran no whole-graph shape inference"
    for sizes in seen:
        assert max(sizes.values()) <= values.VALUE_LIMIT, sizes
        assert 300 in sizes.values(), sizes  # a bias: small values are still seen
    assert [d.dim_value for d in exported.model.graph.input[1].type.tensor_type.shape.dim] == [
        300,
        300,
    ]
    assert_engine_matches_eager(model, (x,), {}, rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:You are using the legacy TorchScript")
def test_other_exports_hand_every_value_to_shape_inference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen = _recording(monkeypatch)
    with values.large_values_hidden():
        pass  # installed, and left
    buf = io.BytesIO()
    torch.onnx.export(_model(), (torch.randn(5, 300),), buf, dynamo=False)  # type: ignore[arg-type]
    assert seen and any(300 * 300 in sizes.values() for sizes in seen)


def test_hidden_values_leave_the_exported_graph_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, x = _model(), torch.randn(5, 300)
    hidden = export(model, (x,), training=True).model
    monkeypatch.setattr(values, "VALUE_LIMIT", 1 << 62)
    seen = _recording(monkeypatch)
    shown = export(model, (x,), training=True).model
    assert any(300 * 300 in sizes.values() for sizes in seen)
    assert hidden.SerializeToString() == shown.SerializeToString()
