"""Labelled rows (part of label sparsity, on by default): the token-wise layers that only a
cross-entropy loss reads run on the labelled tokens, training stays eager's, and where that
cannot be shown the graph is left as exported and the log says why."""

from __future__ import annotations

from typing import Any

import onnx
import pytest
import torch
from hf_models import LOSS_ONLY_MODELS, loss_only_case, trains_like_eager

from ortmodule import ORTModule
from ortmodule_exporter.aten.kernel_choice import CROSS_ENTROPY
from ortmodule_exporter.aten.token_rows import PUT_ROWS, TAKE_ROWS, take_rows
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.sparsity import padding, token_rows
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import ZOO
from ortmodule_testing.zoo.bert import BertConfig, BertEncoder
from ortmodule_testing.zoo.registry import ZooCase

CASE = ZOO["masked_lm"]


def _graph(wrapped: ORTModule) -> onnx.GraphProto:
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None
    return compiled.built.model.graph


def _moves(wrapped: ORTModule) -> list[str]:
    """The row moves of the forward part (the nodes before the engine's ``YieldOp``)."""
    nodes = list(_graph(wrapped).node)
    forward = nodes[: [n.op_type for n in nodes].index("YieldOp")]
    operators = [attribute(n, "operator", "") for n in forward]
    return [op for op in operators if op in (TAKE_ROWS, PUT_ROWS)]


def _lines(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(what)]


def _reads_rows(graph: onnx.GraphProto, suffix: str) -> bool:
    """Whether the node named ``...suffix`` computes on rows taken by a labelled-rows move."""
    producer = {o: n for n in graph.node for o in n.output if o}
    (node,) = [n for n in graph.node if n.name.endswith(suffix)]
    stack, seen = list(node.input), set()
    while stack:
        name = stack.pop()
        writer = producer.get(name)
        if name in seen or writer is None:
            continue
        seen.add(name)
        if attribute(writer, "operator", "") == TAKE_ROWS:
            return True
        if attribute(writer, "operator", "") == "_ortmodule_flash_attention_bshd":
            continue  # attention reads every token: what is upstream of it does not count
        stack.extend(writer.input)
    return False


def test_the_head_and_last_feed_forward_block_run_on_the_labelled_rows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    taken: list[int] = []

    def recorded(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        taken.append(len(rows))
        return take_rows(x, rows)

    monkeypatch.setattr(token_rows, "take_rows", recorded)
    wrapped = trains_like_eager(CASE, 4, caplog)
    # every move takes exactly the labelled tokens of its step (the pass's check at graph build
    # runs the rewritten forward once on the first batch)
    counted = [int((CASE.make_batch(step)[1]["labels"] != -100).sum()) for step in range(4)]
    k = len(taken) // 5
    assert k >= 1 and taken == [n for n in counted[:1] + counted for _ in range(k)], taken
    (decision,) = _lines(caplog, "labelled rows")
    assert decision.startswith("labelled rows on"), decision
    (label,) = _lines(caplog, "label sparsity")
    assert label.startswith("label sparsity on") and "labelled rows already" in label, label
    moves = _moves(wrapped)
    assert TAKE_ROWS in moves and PUT_ROWS not in moves, moves
    graph = _graph(wrapped)
    last = BertConfig.small().n_layers - 1
    assert _reads_rows(graph, "mlm_head/decoder/MatMul")
    assert _reads_rows(graph, f"layers.{last}/ffn/ffn.0/MatMul")
    # the last layer's attention reads every token: its query is computed on all of them
    assert not _reads_rows(graph, f"layers.{last}/attention/query/MatMul")
    # the engine is not asked to shrink the loss a second time
    assert not any(n.op_type == "ShrunkenGather" for n in graph.node)


@pytest.mark.parametrize("name", sorted(LOSS_ONLY_MODELS))
def test_hugging_face_models_returning_their_loss_train_like_eager(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    case = loss_only_case(name)
    wrapped = trains_like_eager(case, 4, caplog)
    (decision,) = _lines(caplog, "labelled rows")
    assert decision.startswith("labelled rows on"), decision
    assert TAKE_ROWS in _moves(wrapped)


def _without_labels(step: int) -> Any:
    """The zoo's batches, with no label counted at step 1."""
    args, kwargs = CASE.make_batch(step)
    if step == 1:
        kwargs = {"labels": torch.full_like(kwargs["labels"], -100)}
    return args, kwargs


class _SigmoidGatedFeedForward(torch.nn.Module):
    """``down(sigmoid(gate(x)) * up(x))``: the gate is PyTorch's sigmoid in an ATen node
    (passes/saturating_tails.py)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(config.d_model, config.d_ff)
        self.up = torch.nn.Linear(config.d_model, config.d_ff)
        self.down = torch.nn.Linear(config.d_ff, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.sigmoid(self.gate(x)) * self.up(x))  # type: ignore[no-any-return]


def test_a_sigmoid_gated_feed_forward_block_runs_on_the_labelled_rows(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def make() -> torch.nn.Module:
        config = BertConfig.small(return_logits=False)
        model = BertEncoder(config)
        for layer in model.layers:
            layer.ffn = _SigmoidGatedFeedForward(config)
        return model

    case = ZooCase("masked_lm_sigmoid_gate", make, CASE.make_batch, CASE.loss_fn)
    wrapped = trains_like_eager(case, 3, caplog)
    (decision,) = _lines(caplog, "labelled rows")
    assert decision.startswith("labelled rows on"), decision
    graph = _graph(wrapped)
    assert not any(n.op_type == "Sigmoid" for n in graph.node)
    last = BertConfig.small().n_layers - 1
    assert _reads_rows(graph, f"layers.{last}/ffn/down/MatMul")
    assert _reads_rows(graph, f"layers.{last}/ffn/gate/MatMul")


def test_a_batch_without_labels_trains_as_with_label_sparsity_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eager's mean over no labels is nan; the engine's loss (with label sparsity on or off) is 0
    with zero gradients. No row of the batch is kept then, which the engine's kernels do not
    survive; the first token is kept instead, and its ignored label adds nothing."""
    case = ZooCase("masked_lm_no_labels", CASE.make_model, _without_labels, CASE.loss_fn)
    model = case.build(seed=0)
    rows = ORTModule(clone_model(model))
    record = train_steps(rows, case, 3)
    assert TAKE_ROWS in _moves(rows)
    monkeypatch.setenv("ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER", "0")
    plain = ORTModule(clone_model(model))
    reference = train_steps(plain, case, 3)
    assert _moves(plain) == []
    assert record.losses[1] == 0.0
    assert_same_training(reference, record, *case.tolerance)


def test_refused_where_the_logits_are_returned_too(caplog: pytest.LogCaptureFixture) -> None:
    def make() -> torch.nn.Module:
        return BertEncoder(BertConfig.small(return_logits=True))

    case = ZooCase("masked_lm_logits", make, CASE.make_batch, CASE.loss_fn)
    wrapped = trains_like_eager(case, 2, caplog)
    (decision,) = _lines(caplog, "labelled rows")
    assert (
        decision.startswith("labelled rows off") and "output.logits is a graph output" in decision
    )
    assert _moves(wrapped) == []


def test_refused_when_most_labels_count(caplog: pytest.LogCaptureFixture) -> None:
    def batch(step: int) -> Any:
        args, _ = CASE.make_batch(step)
        input_ids, mask = args
        return args, {"labels": torch.where(mask.bool(), input_ids, 5)}

    case = ZooCase("masked_lm_dense", CASE.make_model, batch, CASE.loss_fn)
    wrapped = trains_like_eager(case, 1, caplog)
    (decision,) = _lines(caplog, "labelled rows")
    assert decision == "labelled rows off: no loss has under 90% labels", decision
    assert _moves(wrapped) == []


def test_a_failure_leaves_the_graph_to_the_engines_label_sparsity(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("simulated index failure")

    monkeypatch.setattr(padding, "labelled_indices", broken)  # as padding imported it
    wrapped = trains_like_eager(CASE, 2, caplog)
    (decision,) = _lines(caplog, "labelled rows")
    assert decision == "labelled rows off: RuntimeError: simulated index failure", decision
    assert _moves(wrapped) == []
    # the engine still drops the ignored labels before the vocabulary projection
    assert any(n.op_type == "ShrunkenGather" for n in _graph(wrapped).node)


def test_off_with_label_sparsity(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER", "0")
    wrapped = trains_like_eager(CASE, 1, caplog)
    assert _moves(wrapped) == [] and _lines(caplog, "labelled rows") == []


@pytest.mark.parametrize("choice", ["TORCH", "ENGINE"])
def test_the_loss_on_the_labelled_rows_follows_kernel_choice(
    choice: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The exported graph leaves the engine's loss node where label sparsity applies; on the
    labelled rows it takes the kernel choice's route (AUTO times it at their size)."""
    monkeypatch.setenv("ORTMODULE_KERNEL_CHOICE", choice)
    wrapped = trains_like_eager(CASE, 3, caplog)
    assert TAKE_ROWS in _moves(wrapped)
    graph = _graph(wrapped)
    (loss,) = [n for n in graph.node if n.name.endswith("SoftmaxCrossEntropyLoss")]
    if choice == "TORCH":
        assert attribute(loss, "operator", "") == CROSS_ENTROPY
    else:
        assert loss.op_type == "SoftmaxCrossEntropyLoss"
