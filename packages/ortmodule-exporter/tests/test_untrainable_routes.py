"""Operators whose ONNX form the engine cannot train are exported as ATen nodes automatically.

The set comes from the engine's own gradient registry (``aten.engine_gradients`` asks it once per
ONNX operator type), plus shapes its graph checks reject (an axis into a 0-d tensor) and
control flow, on which its gradient builder aborts the process. Each case trains through the
real engine and matches eager (fp32 rtol 1e-4, atol 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_engine_matches_eager

# _aten: the same ORTModule-like ATen export setup (autouse) as the ATen fallback tests
from test_aten_fallback import Head, _aten, _aten_ops, _x  # noqa: F401

from ortmodule_exporter import export
from ortmodule_exporter.aten.engine_gradients import engine_has_gradient, probed


def test_the_engine_is_asked_which_operators_have_gradients() -> None:
    # issue #13 item 2 and issue #20's list: no gradient builder in the 1.19 engine
    for op_type in ("CumSum", "Floor", "Round", "ReduceMax", "Atan", "Softplus", "Elu", "Sign"):
        assert not engine_has_gradient(op_type), op_type
    for op_type in ("Sin", "MatMul", "Softmax", "Gather", "LayerNormalization", "Where"):
        assert engine_has_gradient(op_type), op_type
    assert probed()["ai.onnx::CumSum"] is False


def test_sequence_operators_have_no_engine_gradient() -> None:
    """The engine's builder does not follow a sequence-typed edge (torch_lib writes a
    ``split_with_sizes`` of computed sizes as SplitToSequence + SequenceAt: the split input was
    "unreachable", HF jetmoe on torch_export). The probe reads a sequence output through
    SequenceAt and counts that answer as a no."""
    for op_type in ("SplitToSequence", "SequenceAt", "SequenceConstruct", "ConcatFromSequence"):
        assert not engine_has_gradient(op_type), op_type
    assert engine_has_gradient("Split")


CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cumsum": lambda h: torch.cumsum(h, dim=1),
    "atan": torch.atan,
    "elu": F.elu,
    "hardswish": F.hardswish,
    "amax": lambda h: torch.amax(torch.stack([h, -2 * h], 2), dim=2),
    "floor": lambda h: torch.floor(h) + h,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_untrainable_onnx_form_trains_through_aten(name: str) -> None:
    run = assert_engine_matches_eager(Head(CASES[name]), (_x(5, 4),))
    assert _aten_ops(run.built.exported.model), f"{name} should run in PyTorch"


def test_trainable_onnx_form_stays_onnx() -> None:
    run = assert_engine_matches_eager(Head(torch.sin), (_x(5, 4),))
    assert not _aten_ops(run.built.exported.model)
    assert "Sin" in {n.op_type for n in run.built.exported.model.graph.node}


def test_inference_export_keeps_the_onnx_form() -> None:
    # no gradient is built for an inference graph, so CumSum is fine there
    exported = export(Head(lambda h: torch.cumsum(h, 1)).eval(), (_x(5, 4),), training=False)
    assert "CumSum" in {n.op_type for n in exported.model.graph.node}


class ZeroD(torch.nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.7))
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x * self.w)


@pytest.mark.parametrize(
    "fn",
    [lambda t: torch.softmax(t, 0), lambda t: t.sum(0), lambda t: torch.logsumexp(t, 0)],
    ids=["softmax", "sum", "logsumexp"],
)
def test_axis_into_a_0d_tensor(fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    assert_engine_matches_eager(ZeroD(fn), (torch.tensor(1.3, requires_grad=True),))


def test_control_flow_never_reaches_the_gradient_builder() -> None:
    # torch.diagonal exports an If; the engine's gradient build aborted the process on it
    run = assert_engine_matches_eager(
        Head(lambda h: torch.diagonal(h.reshape(5, 2, 2), 0, 1, 2).repeat(1, 2)), (_x(5, 4),)
    )
    nodes = run.built.exported.model.graph.node
    assert not any(n.op_type == "If" for n in nodes)


def test_string_and_list_arguments_reach_pytorch() -> None:
    def fn(h: torch.Tensor) -> torch.Tensor:
        index = torch.tensor([0, 2])
        reduced = h.index_reduce(0, index, h[:2] * 2, "amax")  # reduce= is a string
        return torch.block_diag(reduced, h[:1])[:5, :4]  # a list of tensors

    run = assert_engine_matches_eager(Head(fn), (_x(5, 4),))
    assert {"index_reduce", "block_diag"} <= set(_aten_ops(run.built.exported.model))
    types = {vi.type.tensor_type.elem_type for vi in run.built.exported.model.graph.value_info}
    assert onnx.TensorProto.STRING not in types


class MaxDim(torch.nn.Module):
    # no other operator: the CPU engine has few bfloat16 kernels (not even Mul)
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.max(x, 1, keepdim=True)
        return values, indices


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_max_with_dim_in_half_precision_keeps_the_dtype(dtype: torch.dtype) -> None:
    # issue #20 B4: TopK has no bfloat16 CPU kernel and ran float16 through float32
    x = torch.randn(4, 6).to(dtype).requires_grad_()
    run = assert_engine_matches_eager(MaxDim(), (x,), rtol=0, atol=0)  # max is exact
    assert run.outputs[0].dtype == dtype
    assert run.outputs[1].dtype == torch.int64
    assert "max" in _aten_ops(run.built.exported.model)


def test_matmul_with_a_vector_operand() -> None:
    # issue #20: 1-D @ 1-D failed to build (FusedMatMul of rank 0), matrix @ vector in backward
    class Vectors(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.v = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 4))

        def forward(self, m: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.matmul(u, self.v), m @ self.v

    run = assert_engine_matches_eager(Vectors(), (_x(3, 4), _x(4)))
    assert _aten_ops(run.built.exported.model)
