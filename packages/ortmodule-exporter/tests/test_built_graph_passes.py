"""Built-graph passes see the engine's gradient model and can change what the session runs."""

from __future__ import annotations

import onnx
import torch

from ortmodule_exporter import export
from ortmodule_exporter.engine import GraphConfig, SessionConfig, TrainingSession, build_graph
from ortmodule_exporter.passes.built_graph import (
    register_built_graph_pass,
    unregister_built_graph_pass,
)


def _double_gradients(model: onnx.ModelProto, config: GraphConfig) -> bool:
    """Scale the weight gradient by 2 (a visible change), only in gradient graphs."""
    if not config.build_gradient:
        return False
    graph = model.graph
    target = next(o.name for o in graph.output if o.name.startswith("weight_grad"))
    for node in graph.node:
        node.output[:] = [f"{o}_raw" if o == target else o for o in node.output]
    graph.node.extend(
        [
            onnx.helper.make_node(
                "Constant", [], ["two"], value=onnx.helper.make_tensor("two", 1, [], [2.0])
            ),
            onnx.helper.make_node("Mul", [f"{target}_raw", "two"], [target]),
        ]
    )
    return True


def test_a_built_graph_pass_changes_what_the_session_runs() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    exported = export(linear, (x,), training=True)
    config = GraphConfig(build_gradient=True, params_to_train=("weight", "bias"))
    seen: list[bool] = []
    register_built_graph_pass("double", lambda m, c: seen.append(True) or _double_gradients(m, c))
    try:
        built = build_graph(exported, config)
    finally:
        unregister_built_graph_pass("double")
    assert seen == [True]
    session = TrainingSession(built, SessionConfig())
    params = dict(linear.named_parameters())
    feeds = [x if n == exported.user_input_names[0] else params[n] for n in built.feed_names]
    _, state = session.forward(feeds)
    grads = session.backward([torch.ones(2, 3)], state)
    by_name = {
        built.grad_of[f]: grads[j] for j, f in enumerate(built.fetch_names) if f in built.grad_of
    }
    linear(x).sum().backward()
    assert linear.weight.grad is not None and linear.bias.grad is not None
    torch.testing.assert_close(by_name["weight"], 2 * linear.weight.grad)
    torch.testing.assert_close(by_name["bias"], linear.bias.grad)
