"""Padding elimination (``ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER=1``): token-wise layers run
on the tokens the attention mask keeps, training stays eager's, and where that cannot be shown
the graph is left as exported and the log says why."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from hf_models import (
    LOSS_ONLY_MODELS,
    NO_DROPOUT,
    adamw,
    loss_only_case,
    padded_mlm_batch,
    trains_like_eager,
)

from ortmodule import ORTModule
from ortmodule_exporter.aten.token_rows import PUT_ROWS, TAKE_ROWS
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_testing.parity import train_steps
from ortmodule_testing.zoo import ZOO, LossOnly
from ortmodule_testing.zoo.bert import BertConfig, BertEncoder
from ortmodule_testing.zoo.registry import ZooCase

OPTION = "ORTMODULE_ENABLE_EMBEDDING_SPARSE_OPTIMIZER"
CASE = ZOO["masked_lm"]


@pytest.fixture
def padding_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OPTION, "1")


def _row_moves(wrapped: ORTModule) -> list[str]:
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None
    return [
        attribute(n, "operator", "")
        for n in compiled.built.model.graph.node
        if attribute(n, "operator", "") in (TAKE_ROWS, PUT_ROWS)
    ]


def _padding_nodes(wrapped: ORTModule) -> int:
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None
    return sum(n.name.startswith("padding_elimination/") for n in compiled.built.model.graph.node)


def _decisions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "padding elimination" in r.getMessage()]


def test_applied_to_the_masked_lm_and_training_matches_eager(
    padding_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    wrapped = trains_like_eager(CASE, 5, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination on (mask input.attention_mask)"), decision
    moves = _row_moves(wrapped)
    # into the region once per layer input, out of it for the attention's query, key and value
    assert moves.count(TAKE_ROWS) >= 2 and moves.count(PUT_ROWS) >= 3, moves


def test_off_by_default(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = trains_like_eager(CASE, 2, caplog)
    # label sparsity's labelled rows moves rows for the head (test_labelled_rows.py)
    assert not _padding_nodes(wrapped) and _decisions(caplog) == []


def _edge_batch(step: int) -> Any:
    """Batches the kept-row rules exist for: labelled tokens at padding positions, one of them in
    a sequence that is all padding (its keys are all masked, so eager's attention averages the
    padding rows, which must then all be computed), and batch and sequence sizes that change
    from step to step."""
    batch, seq = (4, 16) if step % 2 == 0 else (3, 12)
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(2, seq // 2, (batch,), generator=gen)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    ids = torch.randint(2, 128, (batch, seq), generator=gen) * mask
    labels = torch.where(mask.bool() & (torch.rand(batch, seq, generator=gen) < 0.5), ids, -100)
    labels[0, 0] = 7
    if step > 0:  # not in the batch the pass checks itself on: the graph must get these right
        mask[1] = 0
        labels[1, 3] = 11  # a label in the sequence that is all padding
        labels[2, seq - 1] = 9  # a label where the mask says padding
    return (ids, mask), {"labels": labels}


def test_all_padding_sequences_labelled_padding_and_new_shapes_train_like_eager(
    padding_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    case = ZooCase("masked_lm_edges", CASE.make_model, _edge_batch, CASE.loss_fn)
    wrapped = trains_like_eager(case, 4, caplog)
    assert _decisions(caplog)[0].startswith("padding elimination on"), _decisions(caplog)
    assert TAKE_ROWS in _row_moves(wrapped)


def test_refused_when_the_model_returns_logits(
    padding_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The logits at padding positions would be zeros: the user's output would change."""
    case = ZooCase(
        "bert_logits", lambda: BertEncoder(BertConfig.small()), CASE.make_batch, CASE.loss_fn
    )
    wrapped = trains_like_eager(case, 2, caplog)
    (decision,) = _decisions(caplog)
    assert "padding elimination off" in decision and "graph output" in decision, decision
    assert _row_moves(wrapped) == []


class _MeanPooled(torch.nn.Module):
    """Attention over a padded batch, then a mean over every position, padding included: the
    padding rows count, so they may not be skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.embed(ids)
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        additive = (1.0 - mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
        pooled = y.transpose(1, 2).reshape(b, s, 32).mean(dim=1)
        return F.cross_entropy(self.head(pooled), labels)


def _pooled_batch(step: int) -> Any:
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(2, 6, (4,), generator=gen)
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, 64, (4, 12), generator=gen) * mask
    return (ids, mask, torch.randint(0, 3, (4,), generator=gen)), {}


def test_refused_when_padding_rows_reach_a_mean_over_positions(
    padding_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    case = ZooCase("mean_pooled", _MeanPooled, _pooled_batch, lambda out, args, kwargs: out)
    wrapped = trains_like_eager(case, 3, caplog)
    (decision,) = _decisions(caplog)
    assert "padding elimination off" in decision and "ReduceMean" in decision, decision
    assert _row_moves(wrapped) == []


@pytest.mark.parametrize("name", sorted(LOSS_ONLY_MODELS))
def test_hugging_face_models_train_like_eager(
    name: str, padding_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    case = loss_only_case(name)
    wrapped = trains_like_eager(case, 4, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination on (mask input.attention_mask)"), decision
    assert TAKE_ROWS in _row_moves(wrapped)


def _first_step_rng(
    padding: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Any:
    monkeypatch.setenv(OPTION, "1" if padding else "0")
    # hidden dropout on; attention dropout stays 0 (with it, attention is not fused)
    config = tf.BertConfig(**dict(NO_DROPOUT, hidden_dropout_prob=0.1))
    case = ZooCase(
        "hf_bert_dropout",
        lambda: LossOnly(tf.BertForMaskedLM(config)),
        padded_mlm_batch,
        lambda out, a, k: out,
    )
    wrapped = ORTModule(case.build(seed=0))
    torch.manual_seed(123)
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        train_steps(wrapped, case, 1, adamw)
    return torch.get_rng_state(), _padding_nodes(wrapped)


def test_applied_with_dropout_and_the_users_generator_is_left_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Dropout draws differently on every run, so the pass's checks run the graph without it;
    and its runs draw nothing from PyTorch's generator."""
    on_state, on_nodes = _first_step_rng(True, monkeypatch, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination on"), decision
    assert on_nodes
    off_state, off_nodes = _first_step_rng(False, monkeypatch, caplog)
    assert off_nodes == 0
    assert torch.equal(on_state, off_state)


_CLASSIFIERS = {
    "bert": lambda: tf.BertForSequenceClassification(tf.BertConfig(**NO_DROPOUT, num_labels=3)),
    "roberta": lambda: tf.RobertaForSequenceClassification(
        tf.RobertaConfig(**NO_DROPOUT, num_labels=3)
    ),
}


def _classifier_batch(step: int) -> Any:
    """Short sentences in long rows (about 25% real tokens), one class label each; after the
    first batch one sequence is padded on the left, so the position the classifier reads is
    padding there and must be kept all the same."""
    gen = torch.Generator().manual_seed(step)
    lengths = torch.randint(3, 14, (4,), generator=gen)
    mask = (torch.arange(32)[None, :] < lengths[:, None]).long()
    if step > 0:
        mask[1] = mask[1].flip(0)
    ids = torch.randint(5, 128, (4, 32), generator=gen) * mask
    labels = torch.randint(0, 3, (4,), generator=gen)
    return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("name", sorted(_CLASSIFIERS))
def test_sequence_classifiers_read_the_first_token_from_the_rows(
    name: str, padding_on: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A classifier pools ``hidden[:, 0]``: that position is kept in every sequence and read
    from the rows, so the model as it is (loss and logits out, no wrapper) skips the padding."""
    case = ZooCase(
        f"hf_{name}_classifier",
        _CLASSIFIERS[name],
        _classifier_batch,
        lambda out, a, k: out.loss,
    )
    wrapped = trains_like_eager(case, 4, caplog)
    (decision,) = _decisions(caplog)
    assert decision.startswith("padding elimination on (mask input.attention_mask)"), decision
    assert TAKE_ROWS in _row_moves(wrapped)
