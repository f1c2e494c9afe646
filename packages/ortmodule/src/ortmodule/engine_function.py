"""The autograd bridge: the engine's forward and backward halves as one autograd node.

:class:`EngineFunction`'s forward runs the engine's forward half and keeps its state; its
backward runs the backward half and hands every gradient back to autograd, so ``param.grad``
accumulates exactly as in eager.

>>> from ortmodule.engine_function import engine_apply
"""

from __future__ import annotations

from typing import Any

import onnx
import torch

from ortmodule_exporter.components import StepPhases
from ortmodule_exporter.engine import TrainingSession

from .compiled_graph import FLOAT_TYPES, CompiledGraph

__all__ = ["EngineFunction", "engine_apply", "runs_torch"]


#: node types whose kernels are PyTorch code: ATen nodes and PythonOps (custom Functions)
_TORCH_RUN_OPS = frozenset({"ATen", "PythonOp"})


def runs_torch(model: onnx.ModelProto) -> bool:
    """Whether the engine calls back into PyTorch while it runs ``model``."""
    return any(node.op_type in _TORCH_RUN_OPS for node in model.graph.node)


class EngineFunction(torch.autograd.Function):
    """Forward half and backward half of the engine's gradient graph as one autograd node."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, graph: CompiledGraph, phases: StepPhases, *feeds: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        session = graph.session
        assert isinstance(session, TrainingSession)
        outputs, state = session.forward(feeds)
        if graph.copied_outputs:
            copied = graph.copied_outputs
            outputs = [o.clone() if i in copied else o for i, o in enumerate(outputs)]
        ctx.graph = graph
        ctx.phases = phases
        ctx.state = state
        # the shapes of the outputs that take a gradient, for zeros where autograd has none
        ctx.shapes = [outputs[i].shape for i, _, _ in graph.backward_feeds(outputs)]
        ctx.set_materialize_grads(False)
        without_grad = graph.without_grad
        # one call with every such output: each call replaces the set the previous one marked
        marked = [
            out
            for i, out in enumerate(outputs)
            if i in without_grad or out.dtype not in FLOAT_TYPES
        ]
        if marked:
            ctx.mark_non_differentiable(*marked)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():
            # autograd runs a backward with grad mode on only for create_graph=True. The
            # engine's gradients come back as plain tensors, without a graph of their own:
            # handed back, a penalty on them would get no gradient ("does not require grad"),
            # or none silently when added to a loss that has one.
            raise RuntimeError(_HIGHER_ORDER_MESSAGE)
        graph: CompiledGraph = ctx.graph
        state = ctx.state
        if state is None:
            raise RuntimeError(
                "ORTModule: backward ran twice through the same forward; the engine keeps one "
                "forward state per call. Run forward again instead of retain_graph=True."
            )
        ctx.state = None
        feeds = []
        used = frozenset(i for i, g in enumerate(grad_outputs) if g is not None)
        summed = graph.built.summed_output_grads
        for (i, dtype, device), shape in zip(graph.backward_feeds(), ctx.shapes, strict=True):
            grad = grad_outputs[i]
            if grad is None:
                # a gradient the graph only adds to its own takes a 0-d zero (engine.py,
                # summed_output_grads): no tensor of the output's size
                grad = torch.zeros(() if i in summed else shape, dtype=dtype, device=device)
            feeds.append(grad)
        assert isinstance(graph.session, TrainingSession)
        phases: StepPhases = ctx.phases
        for hook in phases.pre_backward:
            hook.pre_backward(phases.ctx)
        grads = graph.session.backward(feeds, state)
        for hook in phases.post_backward:
            hook.post_backward(phases.ctx)
        return (None, None, *[grads[j] if j >= 0 else None for j in graph.returned_grads(used)])


_HIGHER_ORDER_MESSAGE = (
    "ORTModule: higher-order gradients (create_graph=True in torch.autograd.grad or "
    ".backward) do not go through the engine: the gradients it computes cannot be "
    "differentiated again. Compute the term that needs them (a gradient penalty, a Hessian-"
    "vector product) with the wrapped module in eager, e.g. model.module(x), and use the "
    "ORTModule for the rest of the loss; or call backward without create_graph=True."
)


# ``Function.apply`` in Python binds nothing for us (no ``setup_context``) and, outside functorch
# transforms, only unwraps dead functorch wrappers (one C call per tensor) before the C++ apply.
# Our feeds are the user's inputs and the parameters, never such wrappers: call the C++ apply
# directly (about 3 µs a step) and keep the Python path wherever a functorch transform is active.
_C_APPLY = torch._C._FunctionBase.__dict__["apply"].__get__(None, EngineFunction)


def engine_apply(graph: CompiledGraph, phases: StepPhases, feeds: list[torch.Tensor]) -> Any:
    if torch._C._are_functorch_transforms_active():
        return EngineFunction.apply(graph, phases, *feeds)
    return _C_APPLY(graph, phases, *feeds)
