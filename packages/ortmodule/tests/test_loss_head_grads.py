"""The loss's gradient and the output head's products in one node (``loss_head_grads``), and the
logits written by the head's product itself (``product_outputs``): training stays eager's, the
logits the user keeps stay right after the backward, and the parts are checked alone."""

from __future__ import annotations

import copy

import onnx
import pytest
import torch

from ortmodule import ORTModule
from ortmodule_exporter.aten import parallel
from ortmodule_exporter.aten.executor import ATEN_DOMAIN
from ortmodule_exporter.aten.kernel_choice import (
    CROSS_ENTROPY_BACKWARD,
    LOSS_HEAD_BACKWARD,
    MATMUL,
    adds_output_grad,
    loss_head,
)
from ortmodule_exporter.aten.kernel_choice.cross_entropy import _cross_entropy_backward
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes.product_outputs import name_outputs_at_products

transformers = pytest.importorskip("transformers")


def _lm(tied: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=300,
        n_positions=128,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _train(tied: bool, use_logits: bool) -> ORTModule:
    eager = _lm(tied)
    ours = ORTModule(copy.deepcopy(eager))
    kept: dict[str, list[torch.Tensor]] = {"eager": [], "ours": []}
    for step in range(3):
        ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(step))
        grads = []
        for name, model in (("eager", eager), ("ours", ours)):
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=ids)
            loss = out.loss + (out.logits.square().mean() if use_logits else 0)
            before = out.logits.detach().clone()
            loss.backward()
            # the logits the user keeps are not written by the backward
            assert torch.equal(out.logits.detach(), before)
            kept[name].append(out.logits)
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for name, want in grads[0].items():
            torch.testing.assert_close(grads[1][name], want, rtol=1e-4, atol=1e-6)
    for want, got in zip(kept["eager"], kept["ours"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return ours


def _nodes(model: ORTModule) -> list[onnx.NodeProto]:
    graph = model._runner.transitions.current(True, True)
    assert graph is not None
    return list(graph.built.model.graph.node)


@pytest.mark.parametrize("use_logits", [False, True])
@pytest.mark.parametrize("tied", [True, False])
def test_the_head_trains_like_eager_in_one_node(
    tied: bool, use_logits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "TORCH")
    ours = _train(tied, use_logits)
    nodes = _nodes(ours)
    operators = [attribute(n, "operator", "") for n in nodes]
    assert operators.count(LOSS_HEAD_BACKWARD) == 1, operators
    assert CROSS_ENTROPY_BACKWARD not in operators
    (fused,) = [n for n in nodes if attribute(n, "operator", "") == LOSS_HEAD_BACKWARD]
    # the logits' outside gradient is added inside it (a 0-d zero where they are unused)
    assert adds_output_grad(fused)
    # the logits are the head product's own output: not copied at the end of the forward
    (head,) = [n for n in nodes if "output.logits" in n.output]
    assert attribute(head, "operator", "") == MATMUL
    graph = ours._runner.transitions.current(True, True)
    assert graph is not None
    logits_index = list(graph.built.user_output_names).index("output.logits")
    assert logits_index not in graph.copied_outputs


def test_engine_mode_keeps_the_engines_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", "ENGINE")
    operators = {attribute(n, "operator", "") for n in _nodes(_train(True, False))}
    assert not operators & {LOSS_HEAD_BACKWARD, CROSS_ENTROPY_BACKWARD, MATMUL}


def _reference(
    overload: str, inputs: list[torch.Tensor], weight: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    (g,) = _cross_entropy_backward(overload, [t.clone() for t in inputs])
    assert g is not None
    g = g.double()
    return g @ weight.double(), g.t() @ x.double()


@pytest.mark.parametrize("pieces", [1, 2])
@pytest.mark.parametrize(("reduction", "outside"), [(1, None), (2, None), (1, "zero"), (1, "full")])
def test_the_node_against_the_unfused_three(
    reduction: int, outside: str | None, pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # small blocks: several per piece, and a row's class in every block
    monkeypatch.setattr(loss_head, "_BLOCK_ELEMENTS", 6 * 7)
    monkeypatch.setattr(parallel, "width", lambda: pieces)
    gen = torch.Generator().manual_seed(reduction)
    rows, classes, hidden = 6, 23, 5
    logits = torch.randn(rows, classes, generator=gen)
    lse = torch.logsumexp(logits, 1)
    target = torch.tensor([0, 22, 7, -100, 7, 15])  # an ignored row, a repeated class
    total = (target != -100).sum().float()
    params = torch.tensor([reduction, -100])
    grad = torch.tensor(0.7)
    weight = torch.randn(classes, hidden, generator=gen)
    x = torch.randn(rows, hidden, generator=gen)
    shape = torch.tensor([2, 3, classes])
    inputs = [grad, logits, lse, target, total, params]
    overload = ""
    if outside is not None:
        overload = "adds_output_grad"
        extra = torch.zeros(()) if outside == "zero" else torch.randn(2, 3, classes, generator=gen)
        inputs += [extra, shape]
    want_hidden, want_weight = _reference(overload, inputs, weight, x)
    hidden_grad, weight_grad = loss_head._loss_head_backward(
        loss_head.loss_head_overload(overload, False, True), [*inputs, weight, x, shape]
    )
    assert hidden_grad is not None and weight_grad is not None
    assert hidden_grad.shape == (2, 3, hidden) and weight_grad.shape == (classes, hidden)
    torch.testing.assert_close(
        hidden_grad.double(), want_hidden.view(2, 3, hidden), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(weight_grad.double(), want_weight, rtol=1e-5, atol=1e-6)


def _product_graph(second_reader: bool) -> onnx.ModelProto:
    h = onnx.helper
    nodes = [
        h.make_node(
            "ATen",
            ["a", "b"],
            ["p"],
            domain=ATEN_DOMAIN,
            operator=MATMUL,
            overload_name="00|1.0|0.0",
        ),
        h.make_node("Identity", ["p"], ["logits"]),
        h.make_node("YieldOp", ["logits"], ["logits_grad"], domain="com.microsoft"),
    ]
    if second_reader:
        nodes.append(h.make_node("Relu", ["p"], ["r"]))
    f = onnx.TensorProto.FLOAT
    graph = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info(n, f, [2, 2]) for n in ("a", "b")],
        [h.make_tensor_value_info("logits_grad", f, [2, 2])],
        value_info=[h.make_tensor_value_info("p", f, [2, 2])],
    )
    return h.make_model(graph)


@pytest.mark.parametrize("second_reader", [False, True])
def test_an_output_named_by_an_identity_of_a_product(second_reader: bool) -> None:
    model = _product_graph(second_reader)
    assert name_outputs_at_products(model) == (0 if second_reader else 1)
    ops = [(n.op_type, list(n.output)) for n in model.graph.node]
    if second_reader:
        assert ("Identity", ["logits"]) in ops
        return
    assert ("ATen", ["logits"]) in ops and not [o for o in ops if o[0] == "Identity"]
    # the engine cannot infer an ATen node's output type: the product's goes to the output
    assert [vi.name for vi in model.graph.value_info] == ["logits"]
