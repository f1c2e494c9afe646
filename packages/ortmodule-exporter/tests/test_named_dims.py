"""The gradient build gets a graph with named dims: no broadcast reductions where none happen."""

from __future__ import annotations

from collections import Counter

import onnx
import pytest
import torch
from conftest import assert_engine_matches_eager

from ortmodule_exporter import ExportConfig, export, named_dims
from ortmodule_exporter.aten.attention_layout import FLASH, FLASH_BSHD
from ortmodule_exporter.aten.executor import execute
from ortmodule_exporter.aten.kernel_choice.cross_entropy import CROSS_ENTROPY
from ortmodule_exporter.aten.kernel_choice.gelu import GELU
from ortmodule_exporter.aten.kernel_choice.layer_norm import LAYER_NORM
from ortmodule_exporter.aten.output_shapes import output_shape_rules
from ortmodule_exporter.aten.stop_gradient import STOP_GRADIENT
from ortmodule_exporter.engine import GraphConfig, SessionConfig, TrainingSession, build_graph
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes.registry import run_post_export_passes
from ortmodule_exporter.sparsity.token_rows import PUT_ROWS, TAKE_ROWS

BROADCAST_OPS = ("BroadcastGradientArgs", "ReduceSum")


class _Block(torch.nn.Module):
    """Token ids in, as a language model takes them; heads split with ``view`` on runtime sizes,
    merged back, a residual ``Add`` and a ``Mul``."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(10, dim)
        self.proj = torch.nn.Linear(dim, dim, bias=False)
        self.out = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        h = self.proj(x).view(b, s, self.heads, d // self.heads).transpose(1, 2)
        h = torch.tanh(h).transpose(1, 2).reshape(b, s, d)
        y = x + self.out(h)
        return y * torch.sigmoid(y)


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(0, 10, shape)


def _gradient_ops(module: torch.nn.Module, x: torch.Tensor) -> tuple[Counter[str], object]:
    exported = export(module, (x,), training=True)
    run_post_export_passes(exported)
    built = build_graph(
        exported, GraphConfig(build_gradient=True, params_to_train=tuple(exported.param_names))
    )
    model = onnx.load_from_string(built.model_bytes)
    return Counter(n.op_type for n in model.graph.node if n.op_type in BROADCAST_OPS), built


def test_same_shape_operands_get_no_broadcast_reduction() -> None:
    torch.manual_seed(0)
    ops, _ = _gradient_ops(_Block(), _ids(2, 5))
    assert ops == Counter(), ops


def test_without_named_dims_the_engine_reduces_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the named dims save: with inference failing, the builder reduces through
    ``BroadcastGradientArgs`` (the graph is still built and right)."""

    def fail(_model: onnx.ModelProto) -> onnx.ModelProto:
        raise RuntimeError("no inference")

    monkeypatch.setattr(named_dims, "infer_symbolic_shapes", fail)
    torch.manual_seed(0)
    ops, _ = _gradient_ops(_Block(), _ids(2, 5))
    assert ops["BroadcastGradientArgs"] > 0 and ops["ReduceSum"] > 0
    torch.manual_seed(0)
    assert_engine_matches_eager(_Block(), (_ids(2, 5),))


def test_named_dims_train_like_eager_at_other_shapes() -> None:
    """One graph, built at (2, 5), runs batches of other sizes: the names fix no dim."""
    torch.manual_seed(0)
    block = _Block()
    _, built = _gradient_ops(block, _ids(2, 5))
    session = TrainingSession(built, SessionConfig())
    params = dict(block.named_parameters())
    for shape in ((2, 5), (3, 7), (1, 1)):
        x = _ids(*shape)
        feeds = [
            x if n == built.exported.user_input_names[0] else params[n] for n in built.feed_names
        ]
        outputs, state = session.forward(feeds)
        grad_out = torch.randn(*shape, 16)
        grads = session.backward([grad_out], state)
        by_name = {
            built.grad_of[f]: grads[j]
            for j, f in enumerate(built.fetch_names)
            if f in built.grad_of
        }
        block.zero_grad()
        eager = block(x)
        eager.backward(grad_out)
        torch.testing.assert_close(outputs[0], eager.detach())
        for name, p in params.items():
            torch.testing.assert_close(
                by_name[name], p.grad, msg=lambda m, n=name, s=shape: f"{n} at {s}: {m}"
            )


def test_a_float_input_whose_dim_a_weight_fixes_keeps_its_graph() -> None:
    """Inference would make the feature dim of a float input the weight's 16 (ONNX Runtime
    would then check it); the graph is built as exported and trains like eager."""

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.linear(x)

    torch.manual_seed(0)
    _, built = _gradient_ops(Residual(), torch.randn(3, 16))
    model = onnx.load_from_string(built.model_bytes)  # type: ignore[attr-defined]
    assert [d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim] == [
        "input.x_dim0",
        "input.x_dim1",
    ]
    assert_engine_matches_eager(Residual(), (torch.randn(3, 16, requires_grad=True),))


def test_inputs_whose_dims_a_broadcast_makes_one_keep_their_names() -> None:
    """x (4, 64) * w (64,), both requiring grad: inference names w's dim as x's. The inputs keep
    their exported names (other sizes still run), the values below get the inferred ones, and
    the builder has the shape it needs for the broadcast's gradient (built as exported, the
    engine failed: "GetShape(input_grad, input_grad_shape).IsOK() was false")."""

    class Scaled(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return 30.0 * torch.exp(x * w)

    x, w = torch.randn(4, 64), torch.randn(64) * 0.1
    run = assert_engine_matches_eager(
        Scaled(), (x.requires_grad_(), w.requires_grad_()), rtol=1e-5, atol=1e-6
    )
    model = onnx.load_from_string(run.built.model_bytes)
    names = {
        vi.name: [d.dim_param for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input
    }
    assert names["input.x"] == ["input.x_dim0", "input.x_dim1"]
    assert names["input.w"] == ["input.w_dim0"]


def test_inference_that_changes_an_input_dim_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic input dim made fixed would make the engine refuse other sizes."""
    real = named_dims.infer_symbolic_shapes

    def fixing(model: onnx.ModelProto) -> onnx.ModelProto:
        named = real(model)
        named.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
        return named

    monkeypatch.setattr(named_dims, "infer_symbolic_shapes", fixing)
    torch.manual_seed(0)
    ops, built = _gradient_ops(_Block(), _ids(2, 5))
    assert ops["BroadcastGradientArgs"] > 0
    model = onnx.load_from_string(built.model_bytes)  # type: ignore[attr-defined]
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert not dim.HasField("dim_value")


def test_a_named_graph_the_engine_refuses_is_built_as_exported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = named_dims.infer_symbolic_shapes

    def broken(model: onnx.ModelProto) -> onnx.ModelProto:
        named = real(model)
        named.graph.node.append(onnx.helper.make_node("NoSuchOperator", ["x"], ["unused"]))
        return named

    monkeypatch.setattr(named_dims, "infer_symbolic_shapes", broken)
    torch.manual_seed(0)
    ops, _ = _gradient_ops(_Block(), _ids(2, 5))
    assert ops["BroadcastGradientArgs"] > 0


class _RoutedBlock(torch.nn.Module):
    """A GPT-style block whose LayerNorm, attention, GELU and loss PyTorch's kernels run (the
    kernel choice ``torch``), each as an ATen node the engine does not know."""

    def __init__(self, dim: int = 16, heads: int = 2, vocab: int = 10) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, d = x.shape
        q, k, v = (
            t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(self.norm(x)).split(d, dim=2)
        )
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.transpose(1, 2).reshape(b, s, d)
        x = x + torch.nn.functional.gelu(self.mlp(self.norm(x)), approximate="tanh")
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))


def test_our_aten_nodes_get_their_shapes_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """With each ATen node's outputs shaped by its rule, the inference merges nothing and
    makes one pass over the graph (a guessed output met again restarted it from the first
    node: 25 passes, 3.4 s, on GPT-2 small); no dim is a name made up for a node's output."""
    from onnxruntime.tools import symbolic_shape_infer as ssi

    passes = []
    real_pass = ssi.SymbolicShapeInference._infer_impl

    def counted(self: object, *args: object) -> object:
        passes.append(1)
        return real_pass(self, *args)

    monkeypatch.setattr(ssi.SymbolicShapeInference, "_infer_impl", counted)
    torch.manual_seed(0)
    exported = export(
        _RoutedBlock(),
        (_ids(2, 5),),
        training=True,
        config=ExportConfig(kernel_choice="torch", efficient_attention=True),
    )
    run_post_export_passes(exported)
    operators = Counter(
        str(attribute(n, "operator", "")) for n in exported.model.graph.node if n.op_type == "ATen"
    )
    assert {LAYER_NORM, GELU, CROSS_ENTROPY} <= set(operators), operators
    assert {FLASH, FLASH_BSHD} & set(operators), operators
    passes.clear()  # the export's size guards ran it too
    named = named_dims.infer_symbolic_shapes(exported.model)
    assert len(passes) == 1
    dims = {
        d.dim_param
        for vi in (*named.graph.value_info, *named.graph.output)
        for d in vi.type.tensor_type.shape.dim
    }
    assert not [d for d in dims if "__d" in d], sorted(dims)
    assert {"input.ids_dim0", "input.ids_dim1"} <= dims


_TAKE_GRID = torch.tensor([[0, 3], [1, 3]])  # flat position -> kept row (3: left out)
#: each operator with a shape rule, with inputs its kernel runs on, by overload
_RULE_CASES: dict[str, list[tuple[str, list[torch.Tensor | None]]]] = {
    LAYER_NORM: [
        (
            "",
            [
                torch.randn(2, 3, 4),
                torch.ones(4),
                torch.zeros(4),
                torch.tensor([4]),
                torch.tensor(1e-5),
            ],
        ),
    ],
    GELU: [("tanh", [torch.randn(2, 3)])],
    STOP_GRADIENT: [("", [torch.randn(2, 3)])],
    # sigmoid and tanh (passes/saturating_tails.py) and their gradient nodes
    "sigmoid": [("", [torch.randn(2, 3)])],
    "sigmoid_backward": [("", [torch.randn(2, 3), torch.rand(2, 3)])],
    "tanh": [("", [torch.randn(2, 3)])],
    "tanh_backward": [("", [torch.randn(2, 3), torch.rand(2, 3)])],
    CROSS_ENTROPY: [
        ("", [torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, -100]), torch.tensor([1, -100])])
    ],
    FLASH: [
        (
            "",
            [
                torch.randn(2, 3, 5, 4),
                torch.randn(2, 3, 7, 4),
                torch.randn(2, 3, 7, 4),
                torch.tensor(0.0, dtype=torch.float64),
                torch.tensor(False),
                None,
                None,
            ],
        )
    ],
    FLASH_BSHD: [
        (
            flags,
            [
                torch.randn(2, 5, 3, 4) if "q" in flags else torch.randn(2, 3, 5, 4),
                torch.randn(2, 7, 3, 4) if "k" in flags else torch.randn(2, 3, 7, 4),
                torch.randn(2, 7, 3, 4) if "v" in flags else torch.randn(2, 3, 7, 4),
                torch.tensor(0.0, dtype=torch.float64),
                torch.tensor(False),
                None,
                None,
            ],
        )
        for flags in ("qkv", "qkvo", "q", "o", "kv")
    ],
    TAKE_ROWS: [("", [torch.randn(2, 2, 3), torch.tensor([0, 2]), _TAKE_GRID])],
    PUT_ROWS: [("", [torch.randn(3, 4), torch.tensor([0, 2, 3]), torch.tensor([[0, 3], [1, 2]])])],
}


def test_every_shape_rule_gives_the_shapes_its_kernel_makes() -> None:
    """Each registered rule, on the shapes of inputs the operator's kernel runs on, gives the
    shapes of what the kernel returns (every rule has a case here; PyTorch's own ``gelu``
    takes its ``approximate`` as an attribute, the case of our route's node serves it)."""
    rules = output_shape_rules()
    assert set(rules) == {*_RULE_CASES, "gelu"}
    for operator, cases in _RULE_CASES.items():
        for overload, inputs in cases:
            want = [list(t.shape) for t in execute(operator, overload, inputs) if t is not None]
            shapes = [None if t is None else list(t.shape) for t in inputs]
            got = [list(s) if s is not None else None for s in rules[operator](shapes, overload)]
            assert got[: len(want)] == want, (operator, overload)
