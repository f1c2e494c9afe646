"""Export of the model zoo: valid ONNX, a gradient graph the engine builds, eager-equal results."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import pytest
import torch
from conftest import assert_engine_matches_eager

from ortmodule_exporter import (
    ExportError,
    SaveOptions,
    UnsupportedOutputError,
    export,
    register_symbolic,
    unregister_symbolic,
)
from ortmodule_exporter import export as export_fn
from ortmodule_exporter.engine import GraphConfig, build_graph
from ortmodule_testing.zoo import ZOO

export_module = __import__("ortmodule_exporter.export.exporter", fromlist=["export"])


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_exports_checks_and_trains_in_the_engine(name: str) -> None:
    case = ZOO[name]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    exported = export(model, args, kwargs, training=True)
    onnx.checker.check_model(exported.model, full_check=False)
    assert exported.model.ir_version <= 10
    params = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert set(exported.param_names) <= params
    rtol, atol = case.tolerance
    assert_engine_matches_eager(model, args, kwargs, rtol=rtol, atol=atol)


def test_every_input_dim_is_dynamic_unless_static_shapes() -> None:
    case = ZOO["bert"]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    dynamic = export(model, args, kwargs, training=True)
    for vi in dynamic.model.graph.input:
        if vi.name in dynamic.user_input_names:
            assert all(d.dim_param and not d.dim_value for d in vi.type.tensor_type.shape.dim), vi
    static = export(model, args, kwargs, training=True, static_shapes=True)
    for vi in static.model.graph.input:
        if vi.name in static.user_input_names:
            assert all(d.dim_value for d in vi.type.tensor_type.shape.dim), vi


def test_names_come_from_the_pytree_paths() -> None:
    case = ZOO["dict_io"]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    exported = export(model, args, kwargs, training=True)
    assert set(exported.user_input_names) <= set(exported.input_schema.names)
    assert any(n.endswith(".mask") for n in exported.input_schema.names)
    # after the user's outputs: the guard on F.mse_loss's size check (see test_guards)
    names = [o.name for o in exported.model.graph.output]
    assert names[: len(exported.output_schema.names)] == list(exported.output_schema.names)
    assert all(n.startswith("guard.") for n in names[len(exported.output_schema.names) :])


def test_non_tensor_arguments_are_baked_into_the_graph_and_the_schema() -> None:
    case = ZOO["non_tensor_args"]
    model = case.build(seed=0)
    (x,), kwargs = case.make_batch(0)
    a = export(model, (x,), kwargs, training=True)
    b = export(model, (x,), {**kwargs, "scale": 2.0}, training=True)
    assert a.input_schema != b.input_schema
    assert a.user_input_names == b.user_input_names


def test_frozen_parameters_are_inputs_without_gradients() -> None:
    case = ZOO["frozen"]
    model = case.build(seed=0)
    args, kwargs = case.make_batch(0)
    run = assert_engine_matches_eager(model, args, kwargs)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and frozen <= set(run.built.feed_names)
    assert not frozen & set(run.grads)


def test_export_does_not_touch_weights_buffers_or_rng() -> None:
    case = ZOO["cnn"]
    model = case.build(seed=0).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    args, kwargs = case.make_batch(0)
    for deepcopy in (True, False):
        export(model, args, kwargs, training=True, deepcopy=deepcopy)
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), f"{k} changed by export (deepcopy={deepcopy})"
        assert torch.equal(torch.get_rng_state(), rng)


def test_copy_is_skipped_with_a_warning_when_memory_is_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(export_module, "_available_bytes", lambda device: 16)
    model = ZOO["mlp"].build(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args, kwargs = ZOO["mlp"].make_batch(0)
    with pytest.warns(UserWarning, match="not copying .* before export"):
        export(model, args, kwargs, training=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_save_onnx_writes_the_documented_files(tmp_path: Path) -> None:
    model = ZOO["mlp"].build(seed=0)
    args, kwargs = ZOO["mlp"].make_batch(0)
    save = SaveOptions(path=str(tmp_path), prefix="mlp")
    exported = export(model, args, kwargs, training=True, save=save)
    build_graph(
        exported, GraphConfig(build_gradient=True, params_to_train=exported.param_names, save=save)
    )
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "mlp_training_v1_1_exported.onnx",
        "mlp_training_v1_2_pre_gradient.onnx",
        "mlp_training_v1_3_gradient.onnx",
    ]
    for n in names:
        onnx.load(str(tmp_path / n))


@pytest.mark.parametrize("opset", [13, 21, "17"])
def test_out_of_range_opset_is_a_clear_error(opset: object) -> None:
    with pytest.raises(ExportError, match=r"opset"):
        export_fn(torch.nn.Linear(2, 2), (torch.randn(1, 2),), training=True, opset=opset)  # type: ignore[arg-type]


@pytest.mark.parametrize("opset", [14, 17, 18, 20])
def test_supported_opsets_train(opset: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.GELU())
    assert_engine_matches_eager(model, (torch.randn(3, 4),), opset=opset)


class _Odd(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> object:
        return {"y": x * 2, "extra": [x, object()]}


def test_unsupported_output_names_the_output_path() -> None:
    with pytest.raises(UnsupportedOutputError, match=r"output\['extra'\]\[1\]") as info:
        export(_Odd(), (torch.randn(2),), training=True)
    assert "_Odd" in str(info.value)


class _Untraceable(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.chebyshev_polynomial_t(self.fc(x), 3)


def test_export_failure_names_module_and_op_and_chains_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # with the ATen executor installed, torch turns a failing symbolic into an ATen node; the
    # error path is what remains when that route is off
    from ortmodule_exporter.aten import routes as aten_routes

    monkeypatch.setattr(
        aten_routes, "operator_export_type", lambda: torch.onnx.OperatorExportTypes.ONNX
    )
    op = "aten::special_chebyshev_polynomial_t"

    def refuse(g: object, *args: object) -> object:  # what torch raises for an op it cannot export
        raise RuntimeError(
            f"Exporting the operator '{op}' to ONNX opset version 17 is not supported."
        )

    register_symbolic(op, refuse, 14)
    try:
        with pytest.raises(ExportError) as info:
            export(_Untraceable(), (torch.randn(2, 4),), training=True)
    finally:
        unregister_symbolic(op)
    err = info.value
    assert "_Untraceable" in str(err) and err.module_path.endswith("_Untraceable")
    assert err.op == op and f"at operator {op}" in str(err)
    assert isinstance(err.__cause__, RuntimeError)
