"""The session contributor against the real engine, without the ORTModule runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import pytest
import torch

from ortmodule_exporter import export
from ortmodule_exporter.components import SessionContext
from ortmodule_exporter.engine import (
    BuiltGraph,
    GraphConfig,
    SessionConfig,
    TrainingSession,
    build_graph,
)
from ortmodule_memory.plans import read_plan_file
from ortmodule_memory.recompute import CONFIG_ENTRY_PLANS, CONFIG_ENTRY_PROBE, contribute
from ortmodule_testing.zoo.gpt import GPTConfig, GPTDecoder

CONFIG = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)


def _build(options: dict[str, Any]) -> tuple[GPTDecoder, torch.Tensor, BuiltGraph]:
    torch.manual_seed(0)
    model = GPTDecoder(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
    exported = export(model, (ids,), {"labels": ids}, training=True)
    built = build_graph(
        exported, GraphConfig(build_gradient=True, params_to_train=exported.param_names)
    )
    return model, ids, built


def _context(built: BuiltGraph, ids: torch.Tensor, options: dict[str, Any]) -> SessionContext:
    return SessionContext(
        model=onnx.load_from_string(built.model_bytes),
        training=True,
        device=torch.device("cpu"),
        options=options,
        input_shapes={"input.input_ids": tuple(ids.shape), "input.labels": tuple(ids.shape)},
        built=built,
    )


def _step(
    session: TrainingSession, model: GPTDecoder, ids: torch.Tensor, built: BuiltGraph
) -> list[torch.Tensor]:
    params = dict(model.named_parameters())
    feeds = [
        {"input.input_ids": ids, "input.labels": ids}.get(n, params.get(n))
        for n in built.feed_names
    ]
    outputs, state = session.forward(feeds)  # type: ignore[arg-type]
    loss = outputs[0]
    grad_outputs = [torch.ones_like(loss)] + [
        torch.zeros_like(o) for o in outputs[1 : len(built.user_output_names)]
    ]
    return [loss, *session.backward(grad_outputs, state)]


def test_level_1_recomputes_and_changes_nothing(tmp_path: Path) -> None:
    options: dict[str, Any] = {"ORTMODULE_MEMORY_OPT_LEVEL": 1}
    model, ids, built = _build(options)
    contribution = contribute(_context(built, ids, options))
    assert contribution is not None and contribution.memory_efficient_order
    entries = dict(contribution.config_entries)
    assert entries[CONFIG_ENTRY_PROBE] == "1:1"
    plans = read_plan_file(entries[CONFIG_ENTRY_PLANS])
    assert "Gelu+:1:-1" in plans and all(":1:" in p for p in plans)

    optimized = tmp_path / "optimized.onnx"
    recompute = TrainingSession(
        built,
        SessionConfig(
            config_entries=tuple(entries.items()),
            memory_efficient_order=True,
            optimized_model_path=str(optimized),
        ),
    )
    recomputed = [n for n in onnx.load(str(optimized)).graph.node if n.name.endswith("_recompute")]
    # every GELU of both layers is run again in the backward
    assert sum(n.op_type == "Gelu" for n in recomputed) == CONFIG.n_layers
    plain = TrainingSession(built, SessionConfig())
    for got, want in zip(
        _step(recompute, model, ids, built), _step(plain, model, ids, built), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_level_0_without_plans_leaves_the_session_alone() -> None:
    options: dict[str, Any] = {"ORTMODULE_MEMORY_OPT_LEVEL": 0, "ORTMODULE_MEMORY_OPT_CONFIG": None}
    _, ids, built = _build(options)
    assert contribute(_context(built, ids, options)) is None


def test_level_0_user_plans_pass_through(tmp_path: Path) -> None:
    plans = tmp_path / "plans.json"
    plans.write_text('["Gelu+:1:-1"]')
    options: dict[str, Any] = {
        "ORTMODULE_MEMORY_OPT_LEVEL": 0,
        "ORTMODULE_MEMORY_OPT_CONFIG": str(plans),
    }
    _, ids, built = _build(options)
    contribution = contribute(_context(built, ids, options))
    assert contribution is not None
    assert dict(contribution.config_entries) == {
        CONFIG_ENTRY_PLANS: str(plans),
        CONFIG_ENTRY_PROBE: "1:0",
    }


def test_inference_graphs_get_no_recompute() -> None:
    options: dict[str, Any] = {"ORTMODULE_MEMORY_OPT_LEVEL": 2}
    _, ids, built = _build(options)
    ctx = _context(built, ids, options)
    inference = SessionContext(ctx.model, False, ctx.device, ctx.options, ctx.input_shapes, built)
    assert contribute(inference) is None


@pytest.mark.parametrize("level", [1, 2])
def test_named_dims_give_byte_savings(level: int) -> None:
    from ortmodule_memory.recompute import decide

    options: dict[str, Any] = {"ORTMODULE_MEMORY_OPT_LEVEL": level}
    _, ids, built = _build(options)
    decision = decide(_context(built, ids, options))
    assert decision is not None and decision.report is not None
    gelu = next(o for o in decision.report.opportunities if o.cluster_id == "Gelu+:1:-1")
    # the GELU input of each layer: batch * seq * 4 * d_model float32
    assert gelu.saving_bytes == CONFIG.n_layers * ids.numel() * 4 * CONFIG.d_model * 4
