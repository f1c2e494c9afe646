"""The post-export pass: what ORTMODULE_USE_TRITON does on the CPU engine, the verification route
through the real engine, debug dumps and tuning results."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ortmodule_exporter import export, run_post_export_passes
from ortmodule_exporter.engine import GraphConfig, SessionConfig, TrainingSession, build_graph
from ortmodule_triton import (
    TritonConfigError,
    last_report,
    register_triton_pass,
    unregister_triton_pass,
    verification_mode,
)
from ortmodule_triton import graph_pass as graph_pass_module
from ortmodule_triton.kernel import set_launch_chooser

ON = {"ORTMODULE_USE_TRITON": True}


class Block(torch.nn.Module):
    """Linear -> residual LayerNorm -> GELU -> Linear: bias Add + LayerNorm and the GELU chain fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.down = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(torch.nn.functional.gelu(self.ln(h + h)))


@pytest.fixture(autouse=True)
def registered():
    register_triton_pass()
    yield
    unregister_triton_pass()
    set_launch_chooser(None)


def engine_step(module, x, options, extra=()):
    """Export, run the post-export passes, build the gradient graph and run forward + backward
    through the engine's TrainingAgent; returns the output, the gradients by name and the model.
    ``extra``: more positional inputs that take no gradient."""
    exported = export(module, (x, *extra), training=True)
    run_post_export_passes(exported, options)
    params = dict(module.named_parameters())
    built = build_graph(
        exported, GraphConfig(build_gradient=True, params_to_train=tuple(exported.param_names))
    )
    session = TrainingSession(built, SessionConfig())
    users = dict(zip(exported.user_input_names, (x, *extra), strict=False))
    feeds = [users[n] if n in users else params[n].detach() for n in built.feed_names]
    outputs, state = session.forward(feeds)
    dy = torch.randn(outputs[0].shape, generator=torch.Generator().manual_seed(1))
    grads = session.backward([dy], state)
    by_name = {
        built.grad_of[n]: grads[j] for j, n in enumerate(built.fetch_names) if n in built.grad_of
    }
    return outputs[0], by_name, dy, exported.model


def test_cpu_engine_default_logs_once_and_changes_nothing(caplog):
    graph_pass_module._WARNED.discard("cpu")
    module, x = Block(), torch.randn(3, 8)
    with caplog.at_level(logging.WARNING, logger="ortmodule.triton"):
        plain = export(module, (x,), training=True)
        run_post_export_passes(plain, ON)
        again = export(module, (x,), training=True)
        run_post_export_passes(again, ON)
    assert last_report().route == "cpu-engine-unchanged"
    assert [n.op_type for n in plain.model.graph.node] == [
        n.op_type for n in export(module, (x,), training=True).model.graph.node
    ]
    messages = [
        r.message
        for r in caplog.records
        if "needs the CUDA engine" in r.message
        or "Triton kernels need the CUDA engine" in r.message
    ]
    assert len(messages) == 1, messages


def test_off_by_default():
    exported = export(Block(), (torch.randn(2, 8),), training=True)
    run_post_export_passes(exported, {})
    assert last_report().route == "off"
    assert not any(n.op_type == "PythonOp" for n in exported.model.graph.node)


def test_verification_route_trains_like_eager_through_the_engine():
    torch.manual_seed(0)
    module, x = Block(), torch.randn(3, 8)
    eager = Block()
    eager.load_state_dict(module.state_dict())
    with verification_mode():
        out, grads, dy, model = engine_step(module, x, ON)
    report = last_report()
    assert report.route == "verification"
    fused = [n for n in model.graph.node if n.op_type == "PythonOp"]
    assert len(fused) == len(report.runners) >= 1
    fused_ops = " ".join(n.doc_string + str(n.attribute) for n in fused)
    assert "LayerNormalization" in fused_ops and "Erf" in fused_ops
    # the engine ran every fused kernel, forward and backward
    assert all(r.calls >= 1 and r._backward is not None for r in report.runners)
    ops = {n.op_type for n in model.graph.node}
    assert "LayerNormalization" not in ops and "Erf" not in ops
    want = eager(x)
    torch.testing.assert_close(out, want.detach(), rtol=1e-4, atol=1e-5)
    want.backward(dy)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_config_file_limits_ops_and_min_nodes(tmp_path):
    config = tmp_path / "triton_config.json"
    # the user guide's sample spelling (Python's True) is accepted
    config.write_text(
        '{"ops": {"Add": {"versions": [13, 14]}, "Identity": {"versions": [13], "is_no_op": True},'
        ' "LayerNormalization": {"versions": [17]}, "ReduceMean": {"versions": [13, 18]},'
        ' "Sub": {"versions": [13, 14]}}, "initializer": "scalar", "min_nodes": 2}'
    )
    module, x = Block(), torch.randn(3, 8)
    with verification_mode():
        exported = export(module, (x,), training=True)
        run_post_export_passes(exported, {**ON, "ORTMODULE_TRITON_CONFIG_FILE": str(config)})
    kinds = [n.attribute for n in exported.model.graph.node if n.op_type == "PythonOp"]
    # only the residual Add + LayerNorm (with its centring, ReduceMean and Sub); the GELU chain
    # is not allowed
    assert len(kinds) == 1
    assert any(n.op_type == "Erf" for n in exported.model.graph.node)


def test_bad_options_are_named(tmp_path):
    exported = export(Block(), (torch.randn(2, 8),), training=True)
    with pytest.raises(TritonConfigError, match="ORTMODULE_MAX_TUNING_DURATION_MS='soon'"):
        run_post_export_passes(exported, {**ON, "ORTMODULE_MAX_TUNING_DURATION_MS": "soon"})
    bad = tmp_path / "bad.json"
    bad.write_text('{"ops": {"MatMul": {"versions": [13]}}}')
    with pytest.raises(TritonConfigError, match=r"ops.MatMul.*no Triton code generator"):
        run_post_export_passes(exported, {**ON, "ORTMODULE_TRITON_CONFIG_FILE": str(bad)})
    with pytest.raises(TritonConfigError, match="ORTMODULE_TRITON_CONFIG_FILE.*no such file"):
        run_post_export_passes(
            exported, {**ON, "ORTMODULE_TRITON_CONFIG_FILE": str(tmp_path / "x")}
        )


def test_debug_dumps_graphs_and_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with verification_mode():
        engine_step(Block(), torch.randn(2, 8), {**ON, "ORTMODULE_TRITON_DEBUG": True})
    files = sorted(p.name for p in (tmp_path / "triton_debug").iterdir())
    sources = [f for f in files if f.endswith(".py")]
    assert len(sources) >= 2  # forward and gradient kernels
    for source in sources:
        stem = source[: -len(".py")]
        assert f"{stem}.original.onnx" in files and f"{stem}.processed.onnx" in files
        assert "tl.load" in (tmp_path / "triton_debug" / source).read_text()
    graph_pass_module.set_debug(False)


def test_tuning_saves_then_offline_results_are_used(tmp_path):
    results = tmp_path / "tuning.json"
    options = {
        **ON,
        "ORTMODULE_ENABLE_TUNING": True,
        "ORTMODULE_MAX_TUNING_DURATION_MS": 50,
        "ORTMODULE_TUNING_RESULTS_PATH": str(results),
    }
    module, x = Block(), torch.randn(2, 8)
    with verification_mode():
        out_tuned, _, _, _ = engine_step(module, x, options)
    saved = json.loads(results.read_text())
    assert saved["version"] == 1 and saved["kernels"]
    # offline: tuning off, the file's choices are used; rewrite one to prove it is read
    kernel, shapes = next(iter(saved["kernels"].items()))
    shape_key = next(iter(shapes))
    shapes[shape_key] = [128, 1]
    results.write_text(json.dumps(saved))
    from ortmodule_triton.tuning import Tuner

    tuner = Tuner(False, None, results)
    assert tuner.results[kernel][shape_key] == [128, 1]
    with verification_mode():
        out_offline, _, _, _ = engine_step(
            module, x, {**ON, "ORTMODULE_TUNING_RESULTS_PATH": str(results)}
        )
    torch.testing.assert_close(out_offline, out_tuned, rtol=1e-5, atol=1e-6)
