"""Engine-level oracle for exporter tests: export, build the gradient graph, run forward and
backward through the engine's TrainingAgent, and compare with PyTorch eager."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import onnx
import pytest
import torch

from ortmodule_exporter import export, run_post_export_passes
from ortmodule_exporter.engine import (
    BuiltGraph,
    GraphConfig,
    SessionConfig,
    TrainingSession,
    build_graph,
)
from ortmodule_exporter.export import bind_arguments
from ortmodule_pytree import flatten

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def engine_model(graph: onnx.GraphProto, *domains: str) -> onnx.ModelProto:
    """``graph`` as a model the engine (1.19.2) loads: IR version 8, ONNX opset 17 and each of
    ``domains`` (``com.microsoft``, the ATen domain) at version 1."""
    return onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", 17),
            *(onnx.helper.make_opsetid(domain, 1) for domain in domains),
        ],
        ir_version=8,
    )


@dataclass
class EngineRun:
    built: BuiltGraph
    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor]  # graph input name -> gradient from the engine


def _clone_inputs(args: Sequence[Any]) -> list[Any]:
    return [
        a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    ]


def run_engine(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    grad_outputs: Sequence[torch.Tensor] | None = None,
    opset: int = 17,
    **graph_options: Any,
) -> EngineRun:
    kwargs = dict(kwargs or {})
    exported = export(module, args, kwargs, training=module.training, opset=opset)
    run_post_export_passes(exported)
    flat, schema = flatten(bind_arguments(module, args, kwargs), prefix="input")
    index = {n: i for i, n in enumerate(schema.names)}
    params = dict(module.named_parameters())
    trainable = tuple(n for n in exported.param_names if n in params and params[n].requires_grad)
    inputs_rg = tuple(
        n
        for n in exported.user_input_names
        if flat[index[n]].requires_grad and flat[index[n]].dtype in FLOATS
    )
    built = build_graph(
        exported,
        GraphConfig(
            build_gradient=True,
            params_to_train=trainable,
            inputs_require_grad=inputs_rg,
            **graph_options,
        ),
    )
    session = TrainingSession(built, SessionConfig())
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    feeds = [flat[index[n]] if n in index else state[n] for n in built.feed_names]
    outputs, run_state = session.forward(feeds)
    diff = [
        i
        for i, o in enumerate(outputs)
        if i not in built.non_differentiable_outputs and o.dtype in FLOATS
    ]
    if grad_outputs is None:
        gen = torch.Generator().manual_seed(1234)
        grad_outputs = [
            torch.randn(outputs[i].shape, generator=gen, dtype=outputs[i].dtype) for i in diff
        ]
    grads = session.backward(list(grad_outputs), run_state)
    by_name = {
        built.grad_of[name]: grads[j]
        for j, name in enumerate(built.fetch_names)
        if name in built.grad_of
    }
    return EngineRun(built, outputs, by_name)


def assert_engine_matches_eager(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    opset: int = 17,
    **graph_options: Any,
) -> EngineRun:
    """Engine outputs and every input/parameter gradient equal eager's within tolerance.

    ``graph_options`` go to the engine's :class:`GraphConfig`."""
    kwargs = dict(kwargs or {})
    eager_module = copy.deepcopy(module)
    eager_args = _clone_inputs(args)
    eager_kwargs = dict(zip(kwargs, _clone_inputs(list(kwargs.values())), strict=True))
    run = run_engine(module, args, kwargs, opset=opset, **graph_options)

    out = eager_module(*eager_args, **eager_kwargs)
    eager_flat, _ = flatten(out, prefix="output")
    n_user = len(run.built.exported.output_schema.names)
    assert len(eager_flat) == n_user
    for i, (a, b) in enumerate(zip(run.outputs[:n_user], eager_flat, strict=True)):
        torch.testing.assert_close(
            a, b.detach(), rtol=rtol, atol=atol, msg=lambda m, i=i: f"output {i}: {m}"
        )

    diff = [
        i
        for i, o in enumerate(run.outputs)
        if i not in run.built.non_differentiable_outputs and o.dtype in FLOATS and i < n_user
    ]
    gen = torch.Generator().manual_seed(1234)
    grads_out = [
        torch.randn(run.outputs[i].shape, generator=gen, dtype=run.outputs[i].dtype) for i in diff
    ]
    tensors = [eager_flat[i] for i in diff]
    pairs = [(t, g) for t, g in zip(tensors, grads_out, strict=True) if t.requires_grad]
    if pairs:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])

    eager_params = dict(eager_module.named_parameters())
    flat_in, schema = flatten(
        bind_arguments(eager_module, eager_args, eager_kwargs), prefix="input"
    )
    eager_inputs = dict(zip(schema.names, flat_in, strict=True))
    for name, grad in run.grads.items():
        ref = eager_params[name].grad if name in eager_params else eager_inputs[name].grad
        assert ref is not None, f"eager has no gradient for {name}"
        torch.testing.assert_close(
            grad, ref, rtol=rtol, atol=atol, msg=lambda m, name=name: f"grad of {name}: {m}"
        )
    for name, p in eager_params.items():
        if p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0:
            assert name in run.grads, f"the engine produced no gradient for parameter {name}"
    return run


@pytest.fixture(autouse=True)
def _no_silent_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that runs ORTModule must never pass on a PyTorch fallback (tests of the fallback
    itself set ORTMODULE_FALLBACK_POLICY with monkeypatch)."""
    monkeypatch.setenv("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")
