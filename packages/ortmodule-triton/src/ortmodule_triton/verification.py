"""The verification route: fused subgraphs run as PythonOp-wrapped kernels in the CPU engine.

The CPU engine has no ``TritonOp``. To check the whole path (partition, code generation,
gradients) inside real training, each fused subgraph becomes one ``com.microsoft::PythonOp``
calling :class:`TritonSubgraphFunction`: its forward runs the subgraph's kernel, its backward the
kernel of the gradient subgraph (:mod:`ortmodule_triton.autodiff`). On CPU the kernels run under
Triton's interpreter, so this is for tests, never for speed; it is off unless asked for::

    from ortmodule_triton import verification_mode

    with verification_mode():
        ...  # ORTModule(model) with ORTMODULE_USE_TRITON=1 now fuses on the CPU engine
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import torch

from ortmodule_exporter.python_op import PYTHON_OP_DOMAIN, REGISTRY, python_op_node
from ortmodule_exporter.python_op import runner as python_op_runner

from .autodiff import gradient_model
from .codegen import generate
from .debug import dump
from .errors import TritonCodegenError
from .fusion_config import FusionConfig
from .kernel import CompiledSubgraph
from .partition import Subgraph, find_subgraphs, replace_subgraphs

__all__ = [
    "SubgraphRunner",
    "TritonSubgraphFunction",
    "apply_verification_route",
    "verification_enabled",
    "verification_mode",
]

_STATE = threading.local()
_FORCED = [False]


@contextlib.contextmanager
def verification_mode(enabled: bool = True) -> Iterator[None]:
    """Within the block, ``ORTMODULE_USE_TRITON=1`` on the CPU engine fuses through PythonOps."""
    previous = _FORCED[0]
    _FORCED[0] = enabled
    try:
        yield
    finally:
        _FORCED[0] = previous


def verification_enabled() -> bool:
    return _FORCED[0]


class SubgraphRunner:
    """The forward kernel of one subgraph and, built on first use, its gradient kernel."""

    def __init__(self, sub: Subgraph) -> None:
        self.sub = sub
        plan = generate(sub.model)
        dump(plan, sub.model, sub.model)
        self.forward = CompiledSubgraph(plan)
        self._backward: CompiledSubgraph | None = None
        self._wrt: list[int] = []
        self.calls = 0

    def backward_kernel(self) -> tuple[CompiledSubgraph, list[int]]:
        if self._backward is None:
            grad = gradient_model(self.sub.model)
            plan = generate(grad.model)
            dump(plan, self.sub.model, grad.model)
            self._backward, self._wrt = CompiledSubgraph(plan), grad.wrt
        return self._backward, self._wrt

    def gradients(
        self, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], grads: Sequence[Any]
    ) -> list[torch.Tensor | None]:
        kernel, wrt = self.backward_kernel()
        fed = [
            g.contiguous() if isinstance(g, torch.Tensor) else torch.zeros_like(o)
            for g, o in zip(grads, outputs, strict=True)
        ]
        computed = kernel(*inputs, *fed)
        result: list[torch.Tensor | None] = [None] * len(inputs)
        for index, g in zip(wrt, computed, strict=True):
            shape = inputs[index].shape
            # the kernel computes at the broadcast shape; a broadcast input sums its share
            result[index] = g if g.shape == shape else g.sum_to_size(shape).reshape(shape)
        return result


class TritonSubgraphFunction(torch.autograd.Function):
    """Runs a :class:`SubgraphRunner` (argument 0, passed by reference) on the tensors after it."""

    @staticmethod
    def forward(ctx: Any, runner: SubgraphRunner, *tensors: torch.Tensor) -> Any:
        runner.calls += 1
        outputs = runner.forward(*tensors)
        ctx.runner = runner
        ctx.save_for_backward(*tensors, *outputs)
        ctx.count = len(tensors)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        saved = ctx.saved_tensors
        inputs, outputs = saved[: ctx.count], saved[ctx.count :]
        return (None, *ctx.runner.gradients(inputs, outputs, grads))


def _gradient_compiles(sub: Subgraph) -> bool:
    try:
        generate(gradient_model(sub.model).model)
    except (TritonCodegenError, NotImplementedError):
        return False
    return True


def _route_accepts(sub: Subgraph, training: bool) -> bool:
    # bool outputs would cross the PythonOp boundary as uint8; no fused group needs one
    if any(vi.type.tensor_type.elem_type == onnx.TensorProto.BOOL for vi in sub.model.graph.output):
        return False
    return not training or _gradient_compiles(sub)


def _vi_types(sub: Subgraph) -> tuple[list[int], list[int], list[int], list[int]]:
    g = sub.model.graph
    inputs = [vi for vi in g.input if vi.name in sub.inputs]
    return (
        [vi.type.tensor_type.elem_type for vi in inputs],
        [len(vi.type.tensor_type.shape.dim) for vi in inputs],
        [vi.type.tensor_type.elem_type for vi in g.output],
        [len(vi.type.tensor_type.shape.dim) for vi in g.output],
    )


def apply_verification_route(
    model: onnx.ModelProto, config: FusionConfig, training: bool
) -> list[SubgraphRunner]:
    """Replace every fusible subgraph of ``model`` with a PythonOp running its kernels."""
    subgraphs = find_subgraphs(model, config, accept=lambda s: _route_accepts(s, training))
    if not subgraphs:
        return []
    python_op_runner.install()
    entry = REGISTRY.register(TritonSubgraphFunction)
    runners = [SubgraphRunner(s) for s in subgraphs]

    def make(sub: Subgraph, index: int) -> list[onnx.NodeProto]:
        runner = runners[index]
        in_types, in_ranks, out_types, out_ranks = _vi_types(sub)
        for position, elem in enumerate(in_types, start=1):
            if elem == onnx.TensorProto.BOOL:
                entry.bool_inputs.add(position)  # the engine hands bool tensors over as uint8
        name = f"TritonSubgraph_{index}_{runner.forward.plan.fn_name}"
        return [
            python_op_node(
                entry,
                list(sub.inputs),
                [f"{name}.ctx", *sub.outputs],
                name=name,
                convention="c" + "d" * len(sub.inputs),
                types=(in_types, out_types),
                ranks=(in_ranks, out_ranks),
                training=training,
                scalars={"pointer": ([REGISTRY.keep(runner)], [0])},
                comment=" ".join(n.op_type for n in sub.model.graph.node),
            )
        ]

    replace_subgraphs(model, subgraphs, make)
    if not any(o.domain == PYTHON_OP_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(PYTHON_OP_DOMAIN, 1))
    return runners
