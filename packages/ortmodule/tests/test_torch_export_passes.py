"""The post-export passes on graphs the torch_export frontend wrote (issue #40): label sparsity
and recompute train like eager (padding elimination, which starts from the fused attention
node: test_torch_export_routes.py). Fallback is disabled (conftest)."""

from __future__ import annotations

import logging

import pytest

from ortmodule import DebugOptions, ORTModule
from ortmodule_exporter.aten.token_rows import TAKE_ROWS
from ortmodule_exporter.onnx_graph import attribute
from ortmodule_testing.parity import assert_same_training, clone_model, train_steps
from ortmodule_testing.zoo import ZOO

pytest.importorskip("onnxscript")


def _ops(wrapped: ORTModule) -> list[str]:
    compiled = wrapped._runner.transitions.current(training=True, build_gradient=True)
    assert compiled is not None
    return [attribute(n, "operator", "") or n.op_type for n in compiled.built.model.graph.node]


def _messages(caplog: pytest.LogCaptureFixture, topic: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if topic in r.getMessage()]


def test_label_sparsity_is_applied_and_training_matches_eager(
    caplog: pytest.LogCaptureFixture,
) -> None:
    case = ZOO["masked_lm"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=3)
    wrapped = ORTModule(clone_model(model), DebugOptions(exporter="torch_export"))
    with caplog.at_level(logging.INFO, logger="ortmodule"):
        ours = train_steps(wrapped, case, steps=3)
    assert_same_training(eager, ours, *case.tolerance)
    (decision,) = _messages(caplog, "label sparsity")
    assert decision.startswith("label sparsity on for loss"), decision
    assert TAKE_ROWS in _ops(wrapped)


def test_recompute_level_1_is_applied_and_training_matches_eager() -> None:
    pytest.importorskip("ortmodule_memory")
    from ortmodule_memory import memory_report

    case = ZOO["gpt"]
    model = case.build(seed=0)
    eager = train_steps(clone_model(model), case, steps=2)
    options = DebugOptions(exporter="torch_export", memory_opt_level=1)
    wrapped = ORTModule(clone_model(model), options)
    assert_same_training(eager, train_steps(wrapped, case, steps=2), *case.tolerance)
    report = memory_report(wrapped)
    assert report is not None
    # per-layer checkpointing, as under torchscript: the GELU subgraphs, and the query/key/value
    # projection feeding the fused attention node (the levels keep it fused)
    assert any(p.startswith("Gelu+") for p in report.applied), report.applied
    assert any("Split" in p for p in report.applied), report.applied
