"""Label sparsity under ORTModule: when it is applied, that training is unchanged, and the switches.

The zoo's ``masked_lm`` labels about 12% of its tokens and returns only the loss, so the loss,
the head and the last feed-forward block run on the labelled tokens only (labelled rows, see
``test_labelled_rows.py``); where labelled rows is refused, the engine still computes the loss
and the vocabulary projection on them.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from ortmodule import ORTModule
from ortmodule.sparsity import PaddingDecision, SparsityConfig, apply_label_sparsity
from ortmodule_exporter import export
from ortmodule_exporter.aten.token_rows import TAKE_ROWS
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_exporter.passes.density import ENGINE_FLAG, PRINT_ONLY, density_flags
from ortmodule_exporter.sparsity import label_sparsity, labelled_rows
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import ZOO
from ortmodule_testing.zoo.registry import ZooCase

CASE = ZOO["masked_lm"]


def _ops(wrapped: ORTModule) -> list[str]:
    """Operator types, and the operator of each PyTorch-run (ATen) node."""
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None
    graph = compiled.built.model.graph
    return [attribute(n, "operator", "") or n.op_type for n in graph.node]


@pytest.fixture
def engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Labelled rows refused: the engine's own shrinking is what is left."""

    def refused(*_args: Any, **_kwargs: Any) -> PaddingDecision:
        return PaddingDecision(False, "refused by the test")

    monkeypatch.setattr(labelled_rows, "keep_labelled_rows", refused)


def _trains_like_eager(
    steps: int, caplog: pytest.LogCaptureFixture | None = None, level: int = logging.INFO
) -> ORTModule:
    """Train ``masked_lm`` under eager and under ORTModule; assert they match; the wrapper.

    With ``caplog``, the ORTModule steps are captured at ``level`` (set after the wrapper is
    made, which configures the "ortmodule" logger)."""
    model = CASE.build(seed=0)
    eager = train_steps(clone_model(model), CASE, steps=steps)
    wrapped = ORTModule(clone_model(model))
    if caplog is None:
        record = train_steps(wrapped, CASE, steps=steps)
    else:
        with caplog.at_level(level, logger="ortmodule"):
            record = train_steps(wrapped, CASE, steps=steps)
    assert_same_training(eager, record, *CASE.tolerance)
    return wrapped


def _dense_case() -> ZooCase:
    """``masked_lm`` with every real token labelled (density well above 90%)."""

    def batch(step: int) -> Any:
        args, kwargs = CASE.make_batch(step)
        input_ids, mask = args
        return args, {"labels": torch.where(mask.bool(), input_ids, 5)}

    return ZooCase("masked_lm_dense", CASE.make_model, batch, CASE.loss_fn)


def test_applied_by_default_and_training_matches_eager(caplog: pytest.LogCaptureFixture) -> None:
    wrapped = _trains_like_eager(4, caplog, logging.INFO)
    ops = _ops(wrapped)
    assert TAKE_ROWS in ops and "PythonOp" not in ops
    decisions = [r.getMessage() for r in caplog.records if "label sparsity" in r.getMessage()]
    assert len(decisions) == 1 and decisions[0].startswith("label sparsity on for loss")


def test_the_engine_shrinks_the_vocabulary_projection(engine_only: None) -> None:
    # with the loss alone as output, the engine gathers the labelled rows before the decoder
    wrapped = ORTModule(CASE.build(seed=0))
    train_steps(wrapped, CASE, steps=1)
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    graph = compiled.built.model.graph
    producer = {o: n for n in graph.node for o in n.output}
    decoder = [
        n
        for n in graph.node
        if n.op_type in ("MatMul", "Gemm", "FusedMatMul")
        and n.name.endswith("mlm_head/decoder/MatMul")
    ]
    assert decoder, "no decoder projection found"

    def upstream_ops(name: str, depth: int = 12) -> set[str]:
        seen: set[str] = set()
        frontier = [name]
        for _ in range(depth):
            nxt = []
            for t in frontier:
                node = producer.get(t)
                if node is not None:
                    seen.add(node.op_type)
                    nxt.extend(node.input)
            frontier = nxt
        return seen

    assert any("ShrunkenGather" in upstream_ops(n.input[0]) for n in decoder)


@pytest.mark.parametrize(
    "variable",
    [
        "ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER",
        "ORTMODULE_ENABLE_SPARSE_OPTIMIZER",
        "ORTMODULE_ENABLE_COMPUTE_OPTIMIZER",
    ],
)
def test_each_switch_turns_it_off(monkeypatch: pytest.MonkeyPatch, variable: str) -> None:
    monkeypatch.setenv(variable, "0")
    wrapped = _trains_like_eager(2)
    ops = _ops(wrapped)
    assert "ShrunkenGather" not in ops and TAKE_ROWS not in ops and "PythonOp" not in ops


def test_not_applied_when_most_labels_count(caplog: pytest.LogCaptureFixture) -> None:
    case = _dense_case()
    wrapped = ORTModule(case.build(seed=0))
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        train_steps(wrapped, case, steps=1)
    assert "ShrunkenGather" not in _ops(wrapped) and TAKE_ROWS not in _ops(wrapped)
    (line,) = [r.getMessage() for r in caplog.records if "label sparsity" in r.getMessage()]
    assert line.startswith("label sparsity off") and "not below 90%" in line


@pytest.mark.parametrize("optimize", ["1", "0"])
def test_print_input_density_logs_every_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, optimize: str
) -> None:
    monkeypatch.setenv("ORTMODULE_PRINT_INPUT_DENSITY", "1")
    monkeypatch.setenv("ORTMODULE_ENABLE_LABEL_SPARSE_OPTIMIZER", optimize)
    wrapped = _trains_like_eager(3, caplog, logging.WARNING)
    lines = [r.getMessage() for r in caplog.records if "input density" in r.getMessage()]
    label_lines = [line for line in lines if "LABEL" in line]
    embed_lines = [line for line in lines if "EMBED" in line]
    assert len(label_lines) == 3 and len(embed_lines) == 3 and len(lines) == 6
    for step, (label_line, embed_line) in enumerate(zip(label_lines, embed_lines, strict=True)):
        (input_ids, _mask), kwargs = CASE.make_batch(step)
        valid = int((kwargs["labels"] != -100).sum())
        assert f"step {step}: LABEL labels (ignore_index -100)" in label_line
        assert f"({valid} of {input_ids.numel()})" in label_line, label_line
        # the word embedding's padding_idx is 0: its density is the share of real tokens
        tokens = int((input_ids != 0).sum())
        assert f"step {step}: EMBED input_ids (padding_idx 0)" in embed_line
        assert f"({tokens} of {input_ids.numel()})" in embed_line, embed_line
    ops = _ops(wrapped)
    assert "PythonOp" in ops  # the flag stays to print
    # the flag reads the labels before the labelled-rows gather: the densities above are the
    # batch's own
    assert (TAKE_ROWS in ops) == (optimize == "1")


def test_apply_label_sparsity_decisions() -> None:
    model = CASE.build(seed=0)
    args, kwargs = CASE.make_batch(0)
    feeds = {
        "input.input_ids": args[0],
        "input.attention_mask": args[1],
        **{"input.labels": kwargs["labels"]},
    }

    exported = export(model, args, kwargs, training=True)
    (decision,) = apply_label_sparsity(exported, feeds, SparsityConfig(), training=True)
    density = float((kwargs["labels"] != -100).float().mean())
    assert decision.applied and decision.density == pytest.approx(density)
    (flag,) = density_flags(exported.model)
    assert ENGINE_FLAG in str(flag.attribute)
    # symbolic shape inference named the dims the engine needs
    assert any(vi.name == flag.output[1] for vi in exported.model.graph.value_info)

    exported = export(model, args, kwargs, training=False)
    (decision,) = apply_label_sparsity(exported, feeds, SparsityConfig(), training=False)
    assert not decision.applied and density_flags(exported.model) == []

    exported = export(model, args, kwargs, training=True)
    config = SparsityConfig(label=False, print_density=True)
    (decision,) = apply_label_sparsity(exported, feeds, config, training=True)
    assert not decision.applied
    # one print-only flag on the loss's labels, one on the word embedding's indices
    flags = density_flags(exported.model)
    assert sorted(f.name.rsplit("/", 2)[-2] for f in flags) == ["Gather", "SoftmaxCrossEntropyLoss"]
    assert all(PRINT_ONLY in str(f.attribute) for f in flags)

    exported = export(model, args, kwargs, training=True)
    assert apply_label_sparsity(exported, feeds, SparsityConfig(label=False), training=True) == []
    assert density_flags(exported.model) == []


def test_a_failure_leaves_the_exported_graph_untouched(
    engine_only: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_args: Any, **_kwargs: Any) -> str:
        raise RuntimeError("simulated flag failure")

    monkeypatch.setattr(label_sparsity, "insert_density_flag", broken)
    wrapped = _trains_like_eager(2, caplog, logging.WARNING)
    assert "ShrunkenGather" not in _ops(wrapped)
    (line,) = [r.getMessage() for r in caplog.records if "label sparsity skipped" in r.getMessage()]
    assert "simulated flag failure" in line


class _NormLM(torch.nn.Module):
    """Tokens -> features divided by their norm over ``dim`` (an ATen node the exporter runs
    through Python, whose output dims symbolic shape inference makes up, then merges with the
    features' it meets in the division: along the normed dim, wrongly) -> a vocabulary loss."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.emb = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.emb(ids))
        x = x / torch.linalg.vector_norm(x, dim=self.dim, keepdim=True)
        logits = self.head(x)
        return torch.nn.functional.cross_entropy(logits.view(-1, 64), labels.view(-1))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_a_python_run_norm_trains_like_eager_with_label_sparsity_on(
    dim: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Label sparsity names the graph's dims without the build's refusals, so the norm's
    output is named like the features it divides (batch, seq, 16) whatever ``dim`` it keeps
    to 1; the gradients still equal eager's, step after step."""
    torch.manual_seed(0)
    model = _NormLM(dim)
    eager, wrapped = clone_model(model), ORTModule(clone_model(model))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (eager, wrapped)]
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        for step in range(3):
            ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
            labels = torch.full_like(ids, -100)
            labels[:, ::4] = ids[:, ::4]  # 25 % labelled
            for m, optimizer in zip((eager, wrapped), optimizers, strict=True):
                optimizer.zero_grad()
                m(ids, labels).backward()
            for (name, a), b in zip(eager.named_parameters(), wrapped.parameters(), strict=True):
                assert b.grad is not None and a.grad is not None
                torch.testing.assert_close(b.grad, a.grad, msg=lambda m, n=name: f"{n}: {m}")
            for optimizer in optimizers:
                optimizer.step()
    decisions = [r.getMessage() for r in caplog.records if "label sparsity" in r.getMessage()]
    assert decisions and decisions[0].startswith("label sparsity on for loss"), decisions
