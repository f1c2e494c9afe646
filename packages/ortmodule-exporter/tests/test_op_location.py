"""An export error names the submodule that calls the failing operator."""

from __future__ import annotations

import pytest
import torch

from ortmodule_exporter import ExportError, export, register_symbolic, unregister_symbolic

OP = "aten::special_chebyshev_polynomial_t"


class _Poly(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.chebyshev_polynomial_t(x, 3)


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), _Poly())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_export_error_names_the_submodule_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from ortmodule_exporter.aten import routes as aten_routes

    # without the ATen route, torch raises for an operator whose symbolic fails
    monkeypatch.setattr(
        aten_routes, "operator_export_type", lambda: torch.onnx.OperatorExportTypes.ONNX
    )

    def refuse(g: object, *args: object) -> object:
        raise RuntimeError(
            f"Exporting the operator '{OP}' to ONNX opset version 17 is not supported."
        )

    register_symbolic(OP, refuse, 14)
    net = _Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        with pytest.raises(ExportError) as info:
            export(net, (torch.randn(2, 4),), training=True)
    finally:
        unregister_symbolic(OP)
    err = info.value
    assert err.op == OP and err.called_in == "blocks.1.1"
    assert f"at operator {OP} (called in blocks.1.1)" in str(err)
    for name, value in net.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_engine_error_location_from_the_node_name() -> None:
    from ortmodule_exporter.onnx_graph import node_location

    message = (
        "Type Error: Type 'tensor(bool)' of input parameter (/_ortmodule_wrapped/model/Not_output_0)"
        " of operator (CumSum) in node (/_ortmodule_wrapped/model/layers.0/self_attn/CumSum_3) is"
        " invalid."
    )
    assert node_location(message) == " at operator CumSum in model.layers.0.self_attn"
    assert node_location("no node here") == ""
