"""ATen nodes run by PyTorch inside the engine: the executor, the gradients, the routes.

Every model goes through export, the engine's gradient build and forward/backward in the engine
(conftest.run_engine) and matches PyTorch eager (fp32 rtol 1e-4, atol 1e-5). There is no
fallback at this level: an operator the engine could not run fails the test.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import onnx
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_engine_matches_eager, run_engine

from ortmodule_exporter import export, run_post_export_passes
from ortmodule_exporter.aten import executor as aten_executor
from ortmodule_exporter.aten import gradients as custom_gradients
from ortmodule_exporter.aten import routes as aten_routes
from ortmodule_exporter.aten import untrainable
from ortmodule_exporter.aten.executor import UnsupportedAtenOperatorError
from ortmodule_exporter.callback_errors import user_errors
from ortmodule_exporter.engine import (
    GraphConfig,
    InferenceSession,
    SessionConfig,
    TrainingSession,
    build_graph,
)
from ortmodule_exporter.errors import EngineBuildError


@pytest.fixture(autouse=True)
def _aten(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    aten_executor.install()
    custom_gradients.install_gradients()
    aten_routes.configure_aten_routes()
    # What export/exporter.py passes to torch.onnx.export once the ATen executor is wired in: an
    # operator without an ONNX symbolic becomes an ATen node instead of failing the export.
    original = torch.onnx.export

    def export_like_ortmodule(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("operator_export_type", aten_routes.operator_export_type())
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", export_like_ortmodule)
    yield
    aten_routes.configure_aten_routes()


def _aten_ops(model: onnx.ModelProto) -> list[str]:
    """The PyTorch operators the graph runs: ATen nodes, and PythonOps running AtenOp."""
    ops = []
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.domain == "org.pytorch.aten":
            ops.append(attrs.get("operator", node.op_type.encode()).decode())
        elif node.op_type == "PythonOp" and attrs["func_name"].endswith(b"aten.aten_op.AtenOp"):
            ops.append(attrs["comment"].decode().removeprefix("aten::").split(".")[0])
    return ops


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=gen, dtype=dtype, requires_grad=True)


class Head(torch.nn.Module):
    def __init__(self, fn: Any, width: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(width, width)
        self.out = torch.nn.Linear(width, 3)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.fn(self.inp(x)))


# -- the automatic route: operators without an ONNX symbolic ---------------------------------


def test_operators_without_symbolic_train_through_aten() -> None:
    def fn(h: torch.Tensor) -> torch.Tensor:
        return torch.logcumsumexp(torch.special.i0e(h), dim=1)

    run = assert_engine_matches_eager(Head(fn), (_x(5, 4),))
    assert {"special_i0e", "logcumsumexp"} <= set(_aten_ops(run.built.exported.model))
    # an inference graph runs them as ATen nodes through the executor, no PythonOp needed
    head = Head(fn).eval()
    exported = export(head, (_x(5, 4),), training=False)
    run_post_export_passes(exported)
    nodes = exported.model.graph.node
    assert {n.op_type for n in nodes if n.domain == "org.pytorch.aten"} == {"ATen"}
    assert not any(n.op_type == "PythonOp" for n in nodes)
    session = InferenceSession(
        build_graph(exported, GraphConfig(build_gradient=False)), SessionConfig()
    )
    params = dict(head.named_parameters())
    x = _x(5, 4).detach()
    (out,) = session.forward([x if n == "input.x" else params[n] for n in session.built.feed_names])
    torch.testing.assert_close(out, head(x).detach(), rtol=1e-4, atol=1e-5)


class GroupedExperts(torch.nn.Module):
    """Mixture-of-experts' grouped matmul as transformers' default experts call it: rows sorted
    by expert, ``offs`` the running row count per expert (data-dependent, int32)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.weight = torch.nn.Parameter(torch.randn(3, 8, 8, generator=gen))

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        sorted_expert, order = torch.sort(expert)
        counts = torch.histc(sorted_expert.float(), bins=3, min=0, max=2)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = F.grouped_mm(x[order], self.weight, offs=offs).chunk(2, dim=-1)
        return gate.tanh() * up


def test_grouped_mm_trains_through_a_python_op() -> None:
    # the meta kernel of _grouped_mm takes bfloat16 only, so the outputs of its ATen node were
    # left untyped and it reached the engine as a plain ATen node without gradient; the types
    # the trace recorded (routes.TRACED_TYPES) make it an AtenOp PythonOp
    expert = torch.tensor([2, 0, 1, 0, 2, 2, 0])
    run = assert_engine_matches_eager(GroupedExperts(), (_x(7, 8), expert))
    assert "_grouped_mm" in _aten_ops(run.built.exported.model)
    assert not any(
        a.name == untrainable.TRACED_TYPES
        for n in run.built.exported.model.graph.node
        for a in n.attribute
    )


class Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = GroupedExperts()

    def forward(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return self.experts(x, expert)


def test_an_aten_node_without_gradient_is_named_in_the_build_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # without the traced types, _grouped_mm's node stays an untyped ATen node the engine can
    # neither type nor differentiate (in Mixtral: "gradient builder has not been registered:
    # ATen"): the error names the PyTorch operator, its overload and the module
    monkeypatch.setattr(untrainable, "_record_traced_types", lambda *args: None)
    with pytest.raises(EngineBuildError) as info:
        run_engine(Experts(), (_x(7, 8), torch.tensor([2, 0, 1, 0, 2, 2, 0])))
    message = str(info.value)
    assert " at operator ATen (aten::_grouped_mm.default) in experts:" in message
    assert "register_aten_gradient" in message


def test_engine_errors_name_the_operator_an_aten_node_runs() -> None:
    from ortmodule_exporter.engine import _pytorch_operator
    from ortmodule_exporter.onnx_graph import node_location

    def aten(name: str, operator: str, n_inputs: int) -> onnx.NodeProto:
        return onnx.helper.make_node(
            "ATen",
            [f"{name}_{i}" for i in range(n_inputs)],
            [f"{name}_out"],
            name=name,
            domain="org.pytorch.aten",
            operator=operator,
            overload_name="",
        )

    graph = onnx.helper.make_graph(
        [
            aten("/_ortmodule_wrapped/model/mlp/ATen_3", "index_fill", 4),
            aten("/_ortmodule_wrapped/head/ATen", "histc", 4),
        ],
        "g",
        [],
        [],
    )
    message = "The gradient builder has not been registered: ATen for node "
    mlp, head = (f"{message}/_ortmodule_wrapped/{p}" for p in ("model/mlp/ATen_3", "head/ATen"))
    assert node_location(mlp) == " at operator ATen in model.mlp"
    # an empty overload is named as the executor resolves it, by argument count
    where = node_location(mlp, graph, _pytorch_operator)
    assert where == " at operator ATen (aten::index_fill.int_Scalar) in model.mlp"
    where = node_location(head, graph, _pytorch_operator)
    assert where == " at operator ATen (aten::histc.default) in head"


def test_symbolic_that_gives_up_becomes_an_aten_node() -> None:
    # a non-zero threshold has no ONNX form; the exporter leaves org.pytorch.aten::threshold
    run = assert_engine_matches_eager(Head(lambda h: F.threshold(h, 0.1, 0.5)), (_x(5, 4),))
    assert "threshold" in _aten_ops(run.built.exported.model)
    assert all(
        n.op_type == "ATen"
        for n in run.built.exported.model.graph.node
        if n.domain == "org.pytorch.aten"
    )
    assert not any(n.op_type == "threshold" for n in run.built.exported.model.graph.node)


class IntMask(torch.nn.Module):
    """CPM-Ant's attention mask: an int32 tensor or-ed and and-ed with bool ones (PyTorch
    promotes to int32; ONNX's Or/And take bool only, so both export as ATen nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(4, 4, dtype=torch.bool).tril()
        mask = context[:, None, :] | (context[:, :, None].logical_not() & causal)
        mask = mask & (context[:, None, :] >= 0)
        return self.proj(x).masked_fill(mask == torch.tensor(False), -1e4).softmax(-1)


def test_python_operators_keep_their_name_on_aten_nodes() -> None:
    # the exporter takes the last "_" of aten::__or__ for an in-place mark and names the ATen
    # node __or_, an operator PyTorch has not ("PyTorch has no operator aten::__or_")
    context = torch.tensor([[1, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.int32)
    run = assert_engine_matches_eager(IntMask(), (_x(2, 4, 4), context))
    assert {"__or__", "__and__"} <= set(_aten_ops(run.built.exported.model))


def test_antialiased_resampling_is_routed() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.interpolate(self.conv(x), size=(4, 3), mode="bicubic", antialias=True)

    run = assert_engine_matches_eager(Model(), (_x(2, 2, 7, 6),))
    assert "_upsample_bicubic2d_aa" in _aten_ops(run.built.exported.model)


def test_einsum_in_float64_runs_in_pytorch() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.randn(2, 3, 4, dtype=torch.float64))
            self.b = torch.nn.Parameter(torch.randn(2, 4, 5, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.einsum("bij,bjk->bik", self.a * x, self.b * x)

    run = assert_engine_matches_eager(Model(), (torch.tensor(1.5, dtype=torch.float64),))
    assert aten_routes.EINSUM in _aten_ops(run.built.exported.model)


# -- explicit routes with their backward operator ---------------------------------------------


def test_embedding_with_padding_idx_through_aten() -> None:
    aten_routes.configure_aten_routes(embedding=True)

    class Model(torch.nn.Module):
        def __init__(self, by_freq: bool) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, padding_idx=0, scale_grad_by_freq=by_freq)
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.lin(self.emb(idx))

    idx = torch.tensor([[0, 1, 2], [3, 0, 0], [5, 5, 0], [9, 9, 1]])
    for by_freq in (False, True):
        run = assert_engine_matches_eager(Model(by_freq), (idx,))
        ops = _aten_ops(run.built.model)
        assert "embedding" in ops and "embedding_backward" in ops
        assert torch.count_nonzero(run.grads["emb.weight"][0]) == 0  # the padding row


@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal"])
def test_sdpa_fallback_matches_eager(mask: str) -> None:
    aten_routes.configure_aten_routes(sdpa_fallback=True)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
            kwargs: dict[str, Any] = {}
            if mask in ("bool", "float"):
                kwargs["attn_mask"] = m
            if mask == "causal":
                kwargs["is_causal"] = True
            return F.scaled_dot_product_attention(q, k, v, **kwargs).sum(1)

    bool_mask = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    bool_mask[..., 0] = True
    m = bool_mask if mask == "bool" else torch.randn(2, 1, 5, 5)
    run = assert_engine_matches_eager(Attention(), (_x(2, 5, 8), m))
    ops = _aten_ops(run.built.model)
    assert "_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "_scaled_dot_product_flash_attention_for_cpu_backward" in ops


def test_sdpa_with_dropout_keeps_the_onnx_export() -> None:
    aten_routes.configure_aten_routes(sdpa_fallback=True)

    def fn(h: torch.Tensor) -> torch.Tensor:
        q = h.view(1, 1, -1, 4)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).view(-1, 4)

    exported = export(Head(fn), (_x(5, 4),), training=True)
    assert "_scaled_dot_product_flash_attention_for_cpu" not in _aten_ops(exported.model)


def test_efficient_attention_fuses_the_unfused_pattern() -> None:
    aten_routes.configure_aten_routes(efficient_attention=True)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24)

        def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            b, s, _ = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
            scores = q @ k.transpose(-2, -1) / math.sqrt(4) + bias
            return (scores.softmax(-1) @ v).sum(1)

    run = assert_engine_matches_eager(Attention(), (_x(2, 5, 8), torch.randn(2, 1, 5, 5)))
    model = run.built.exported.model
    assert "_scaled_dot_product_flash_attention_for_cpu" in _aten_ops(model)
    assert not any(n.op_type == "Softmax" for n in model.graph.node)


# -- the executor itself ------------------------------------------------------------------------


def test_executor_reads_every_argument_kind() -> None:
    x = torch.arange(12.0).view(3, 4)
    (total,) = aten_executor.execute(
        "aten::sum", "dim_IntList", [x, torch.tensor([1]), torch.tensor(True), None]
    )
    assert torch.equal(total, x.sum(1, keepdim=True))
    (cast,) = aten_executor.execute(
        "_to_copy", "", [x, torch.tensor(4), None, None, None, torch.tensor(0), None]
    )
    assert cast.dtype == torch.int64  # a dtype argument arrives as its scalar-type code
    (filled,) = aten_executor.execute("fill", "Scalar", [x, torch.tensor(2.5, dtype=torch.float64)])
    assert torch.all(filled == 2.5)
    assert aten_executor.is_tensor_argument("embedding", "", 0, True)
    assert not aten_executor.is_tensor_argument("embedding", "", 2, True)
    assert aten_executor.is_tensor_argument("embedding", "", 0, False)


def test_executor_runs_registered_operators_only() -> None:
    """aten operators and registered custom ones (``ns::op``, looked up in ``torch.ops``:
    nothing is imported by name); never TorchScript's or the decompositions' primitives."""
    with pytest.raises(UnsupportedAtenOperatorError, match="no operator os::system"):
        aten_executor.execute("os::system", "", [None])
    with pytest.raises(UnsupportedAtenOperatorError, match="only aten:: and custom"):
        aten_executor.execute("prims::add", "", [None, None])
    with pytest.raises(UnsupportedAtenOperatorError, match="no operator"):
        aten_executor.execute("no_such_operator_anywhere", "", [])
    with pytest.raises(ValueError):
        aten_executor.register_aten_function(
            "embedding", aten_executor.AtenFunction(lambda o, i: i, lambda o, i, x: True)
        )


def test_an_operator_error_reaches_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    real = aten_executor.execute

    def failing(op: str, overload: str, inputs: list[Any]) -> Any:
        if op == "special_i0e" and not any(t is not None and t.is_meta for t in inputs):
            raise ArithmeticError("i0e failed inside the engine")
        return real(op, overload, inputs)

    monkeypatch.setattr(aten_executor, "execute", failing)
    with pytest.raises(ArithmeticError, match="inside the engine") as info, user_errors():
        run_engine(Head(torch.special.i0e), (_x(5, 4),))
    assert any("special_i0e" in n for n in getattr(info.value, "__notes__", []))


def test_an_error_inside_the_executor_reaches_the_caller() -> None:
    aten_routes.configure_aten_routes(embedding=True)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4, padding_idx=0)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.emb(idx)

    model = Model()
    built = run_engine(model, (torch.tensor([[1, 2]]),)).built
    session = TrainingSession(built, SessionConfig())
    calls = aten_executor.call_count()
    bad = torch.tensor([[1, 12]])  # row 12 of 10
    feeds = [bad if n == "input.idx" else model.emb.weight for n in built.feed_names]
    with pytest.raises(IndexError) as info, user_errors():
        session.forward(feeds)
    assert any("ATen node embedding" in n for n in getattr(info.value, "__notes__", []))
    assert aten_executor.call_count() == calls  # the failed call is not counted


def test_a_gradient_in_the_broadcast_shape_is_summed_to_the_output_shape() -> None:
    # the engine can hand an ATen node the gradient of the shape its output was broadcast to
    # (fuzzer seed 56: (1, 3, 6) for a (3, 6) output; apertus: (128,) for (1,))
    from ortmodule_exporter.aten.aten_op import _to_output_shape

    grad = torch.arange(12.0).reshape(2, 1, 6)
    out = torch.zeros(1, 6)
    torch.testing.assert_close(_to_output_shape(grad, out), grad.sum(0))
    assert _to_output_shape(out, out) is out
    with pytest.raises(RuntimeError, match=r"shape \(2, 1, 6\) for an output of shape \(4,\)"):
        _to_output_shape(grad, torch.zeros(4))
