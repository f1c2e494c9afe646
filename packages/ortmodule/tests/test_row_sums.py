"""Bias gradients on PyTorch's ``sum`` (the ``row_sums`` built-graph pass of the kernel choice):
the engine's ``ReduceSum`` over a batch's leading axes becomes an ATen node where PyTorch was
measured faster, and training stays eager's."""

from __future__ import annotations

from collections.abc import Iterator

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortmodule import ORTModule
from ortmodule_exporter.aten import kernel_choice
from ortmodule_exporter.aten.kernel_choice import row_sum
from ortmodule_exporter.passes.row_sums import route_row_sums
from ortmodule_testing.parity import clone_model


class Tokens(torch.nn.Module):
    """Linear layers over (batch, seq, features): the engine writes each bias's gradient as a
    ReduceSum over axes [0, 1]; the position bias (seq, features) sums over axis 0 only."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 24)
        self.down = torch.nn.Linear(24, 8)
        self.position = torch.nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x + self.position)))


def _row_sum_nodes(model: ORTModule) -> tuple[int, int]:
    """(ATen row sums, ReduceSum nodes) in the training graph the engine runs."""
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    nodes = graph.built.model.graph.node
    operators = [next((a.s for a in n.attribute if a.name == "operator"), b"") for n in nodes]
    return (
        operators.count(kernel_choice.ROW_SUM.encode()),
        sum(n.op_type == "ReduceSum" for n in nodes),
    )


def _train_like_eager() -> ORTModule:
    torch.manual_seed(0)
    eager = Tokens()
    ours = ORTModule(clone_model(eager))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, ours)]
    gen = torch.Generator().manual_seed(0)
    for batch in (3, 3, 2):  # a new batch size: the graph's sums take the rows it is given
        x = torch.randn(batch, 5, 8, generator=gen)
        for model, opt in zip((eager, ours), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
        for (name, p_ours), p_eager in zip(
            ours.named_parameters(), eager.parameters(), strict=True
        ):
            torch.testing.assert_close(p_ours.grad, p_eager.grad, rtol=1e-5, atol=1e-6, msg=name)
        for opt in opts:
            opt.step()
    return ours


def test_bias_gradients_on_torch_sum_train_like_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    row_sums, _ = _row_sum_nodes(_train_like_eager())
    # the two biases; the position parameter's sum keeps a 2-d result and stays on the engine
    assert row_sums == 2


def test_engine_mode_keeps_its_reduce_sum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    row_sums, reduce_sums = _row_sum_nodes(_train_like_eager())
    assert row_sums == 0 and reduce_sums >= 2


def test_row_sum_function_sums_the_leading_axes() -> None:
    x = torch.randn(3, 4, 6)
    (out,) = kernel_choice._row_sum("2", [x])
    torch.testing.assert_close(out, x.sum((0, 1)))
    (out,) = kernel_choice._row_sum("1", [x[0]])
    torch.testing.assert_close(out, x[0].sum(0))


# -- the pass on hand-made graphs -------------------------------------------------------------------


def _graph(
    axes: list[int],
    keepdims: int = 0,
    elem: int = TensorProto.FLOAT,
    out_dims: list[int | str] | None = None,
) -> onnx.ModelProto:
    node = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=keepdims, name="sum")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", elem, ["b", "s", 16])],
        [helper.make_tensor_value_info("y", elem, out_dims if out_dims is not None else [16])],
        [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)],
    )
    return helper.make_model(graph)


@pytest.fixture
def mode() -> Iterator[None]:
    before = kernel_choice.current_mode()
    yield
    kernel_choice.configure_kernel_choice(before)


@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize("axes", [[0, 1], [1, 0]])
def test_pass_rewrites_a_leading_axes_sum(axes: list[int]) -> None:
    kernel_choice.configure_kernel_choice("torch")
    model = _graph(axes)
    assert route_row_sums(model, "cpu") == 1
    (node,) = model.graph.node
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "ATen" and list(node.input) == ["x"] and list(node.output) == ["y"]
    assert attrs == {"operator": kernel_choice.ROW_SUM.encode(), "overload_name": b"2"}


@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize(
    "model",
    [
        _graph([0, 1], keepdims=1, out_dims=[1, 1, 16]),  # keeps the summed axes
        _graph([0, 2], out_dims=["s"]),  # not a leading run
        _graph([0, 1], elem=TensorProto.INT64),  # torch.sum would widen int32; ints stay
        _graph([0], out_dims=["s", 16]),  # a 2-d result: not a bias gradient
        _graph([0, 1], out_dims=["n"]),  # width unknown: nothing to measure
    ],
    ids=["keepdims", "not-leading", "int", "2d-result", "unknown-width"],
)
def test_pass_leaves_other_sums(model: onnx.ModelProto) -> None:
    kernel_choice.configure_kernel_choice("torch")
    assert route_row_sums(model, "cpu") == 0
    assert model.graph.node[0].op_type == "ReduceSum"


@pytest.mark.usefixtures("mode")
def test_pass_keeps_the_engine_on_cuda_and_in_engine_mode() -> None:
    kernel_choice.configure_kernel_choice("torch")
    assert route_row_sums(_graph([0, 1]), "cuda") == 0
    kernel_choice.configure_kernel_choice("engine")
    assert route_row_sums(_graph([0, 1]), "cpu") == 0


@pytest.mark.usefixtures("mode")
@pytest.mark.parametrize(("engine_us", "torch_us", "rewritten"), [(90.0, 30.0, 1), (30.0, 90.0, 0)])
def test_auto_rewrites_only_where_torch_measured_faster(
    engine_us: float, torch_us: float, rewritten: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel_choice.configure_kernel_choice("auto")
    # a width no other test measures, so the decision is made here
    width = 97 if rewritten else 98
    seen: list[tuple[int, int]] = []

    def measure(rows: int, cols: int) -> tuple[float, float]:
        seen.append((rows, cols))
        return engine_us, torch_us

    monkeypatch.setattr(row_sum, "measure_row_sum", measure)
    assert route_row_sums(_graph([0, 1], out_dims=[width]), "cpu") == rewritten
    assert seen == [(kernel_choice.CALIBRATION_NUMEL // width, width)]
    key = (f"row_sum({width})", "Float", kernel_choice.CALIBRATION_NUMEL // width)
    assert kernel_choice.decisions()[key][0] == ("torch" if rewritten else "engine")


def test_row_sum_measurement_times_both_kernels() -> None:
    engine_us, torch_us = kernel_choice.measure_row_sum(256, 64)
    assert engine_us > 0 and torch_us > kernel_choice.ATEN_NODE_US
