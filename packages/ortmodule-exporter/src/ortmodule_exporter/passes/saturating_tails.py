"""ONNX ``Sigmoid`` and ``Tanh`` run in PyTorch where the engine's kernels lose their tails.

**Sigmoid.** The engine's kernel (1.19.2; CPU, MLAS) is accurate to about 1e-7 absolute, not
relative: 2e-4 off at x = -10, 116 % at x = -17 and 0 from x = -18 on, where the true value is
1.5e-8 and less. A gradient through a saturated sigmoid then came out 0 where eager's is small:
Hugging Face ``bailing_hybrid``'s forget gate (``lower_bound * sigmoid(...)``) had 1984 of its
``f_proj`` weight's 2048 first-step gradient elements 0 where float64 and eager have 1e-13 to
1e-9, and AdamW, which divides by each element's own gradient size, moved those weights by up
to a learning rate a step in eager and not at all in the engine. The same holds for every
gate: ``glu``'s, a torch_lib translation's, a user's ``torch.sigmoid``.

**Tanh.** The engine's kernel is 4-5 ulps off where PyTorch's is correctly rounded (x from 1
to 9), and the gradient ``1 - y*y`` turns that into a relative error that grows as the tanh
saturates: 3 times eager's in the median, up to 7 times. A saturating tanh recurrence (fuzz seed
56590, ``tanh(h * p + x_t)`` over 4 steps) had its input gradient 17 times farther from float64
than eager's; Gemma's logit soft-capping (``cap * tanh(logits / cap)``) is such a tanh.

This pass makes each such node an ATen ``sigmoid``/``tanh`` node, which PyTorch runs inside the
engine; its gradient is PyTorch's ``sigmoid_backward``/``tanh_backward`` reading the node's
output (registered below, with the shape rules that keep the graph's named dims), on both
frontends and in eval graphs. An ATen node's output has no type the engine can infer, so the
pass declares it (the input's, from ONNX shape inference); a Tanh whose input's rank ONNX
inference does not know stays on the engine: Hugging Face ``xlstm``'s gradient build failed on
one (the engine's gradient of an ``Unsqueeze`` below it needs the rank, and only the engine's
own Tanh carried it).

Kept on the engine, where a fused kernel reads them:

- silu's ``Mul(x, Sigmoid(x))`` (``F.silu``, a user's ``x * torch.sigmoid(x)``), which the engine
  fuses into one ``QuickGelu`` kernel and its memory optimizer can recompute. Its error is |x|
  times the Sigmoid's: at most about 2e-6 absolute (at x = -17), and where the Sigmoid is 0
  (x <= -18) silu's true gradient is itself under 2.7e-7 in size. A gate, which multiplies
  another value by the sigmoid, is what the pass moves.
- the tanh GELU's ``Add(1, Tanh(...))`` (Hugging Face ``gelu_new``), which the engine fuses into
  ``FastGelu``, as close to float64 as eager's.

Written down in docs/guarantees.md.

>>> from ortmodule_exporter.passes.saturating_tails import saturating_tails_to_pytorch
>>> saturating_tails_to_pytorch(model)  # done by a post-export pass; returns the nodes it moved
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from ..aten.executor import ATEN_DOMAIN
from ..aten.gradients import GradientNode, register_aten_gradient
from ..aten.output_shapes import input_shape, register_output_shapes
from ..onnx_graph import (
    constant_values,
    import_domain,
    inferred_value_shapes,
    producers_and_consumers,
)
from .registry import register_post_export_pass

__all__ = ["SIGMOID", "TANH", "saturating_tails_to_pytorch"]

SIGMOID = "sigmoid"
TANH = "tanh"

for _operator in (SIGMOID, TANH):
    register_output_shapes(_operator, input_shape)
    register_output_shapes(f"{_operator}_backward", input_shape)
    register_aten_gradient(
        _operator,
        "",
        [GradientNode.aten(f"{_operator}_backward", ["GO(0)", "O(0)"], ["GI(0)"])],
    )


class _Graph:
    """What the pass reads of a model's graph: each value's writer and readers, its constants
    and the types ONNX shape inference gives (both found when first asked for)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model, self.graph = model, model.graph
        self.writers, self.readers = producers_and_consumers(model.graph)
        self._constants: dict[str, np.ndarray] | None = None
        self._shapes: dict[str, tuple[int, list[int | None] | None]] | None = None

    def shape(self, name: str) -> tuple[int, list[int | None] | None] | None:
        """(element type, dims) of ``name`` by ONNX shape inference; the first call must come
        before the pass moves a node, while the engine's Sigmoid/Tanh outputs still type the
        values below them."""
        if self._shapes is None:
            self._shapes = inferred_value_shapes(self.model)
        return self._shapes.get(name)

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` where it is a constant, through Casts (torch_export writes
        ``1.0`` as a Cast of a double)."""
        if self._constants is None:
            self._constants = constant_values(self.graph)
        while name not in self._constants:
            writer = self.writers.get(name)
            if writer is None or writer.op_type not in ("Cast", "Identity"):
                return None
            name = writer.input[0]
        return self._constants[name]


def _is_silu(node: onnx.NodeProto, graph: _Graph) -> bool:
    """``node`` is the Sigmoid of ``Mul(x, Sigmoid(x))``, its only reader that Mul."""
    read_by = graph.readers.get(node.output[0], [])
    if len(read_by) != 1:
        return False
    mul = read_by[0]
    return (
        mul.op_type == "Mul"
        and mul.domain in ("", "ai.onnx")
        and sorted(mul.input) == sorted([node.input[0], node.output[0]])
    )


def _is_tanh_gelu(node: onnx.NodeProto, graph: _Graph) -> bool:
    """``node`` is the Tanh of ``Add(1, Tanh(...))``, its only reader that Add."""
    read_by = graph.readers.get(node.output[0], [])
    if len(read_by) != 1:
        return False
    add = read_by[0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return False
    other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
    value = graph.constant(other)
    return value is not None and value.size >= 1 and bool(np.all(value == 1))


#: ONNX operator -> (ATen operator, the pattern that keeps a node on the engine, whether the
#: node moves when the input's rank is not known)
_MOVED: dict[str, tuple[str, Callable[[onnx.NodeProto, _Graph], bool], bool]]
_MOVED = {"Sigmoid": (SIGMOID, _is_silu, True), "Tanh": (TANH, _is_tanh_gelu, False)}


def saturating_tails_to_pytorch(model: onnx.ModelProto) -> int:
    """Make every ONNX ``Sigmoid`` and ``Tanh`` of ``model`` but those a fused kernel reads an
    ATen node; returns how many it made."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    candidates = [
        slot
        for slot, node in enumerate(graph.node)
        if node.op_type in _MOVED and node.domain in ("", "ai.onnx")
    ]
    if not candidates:
        return 0
    read = _Graph(model)
    declared = {vi.name for vi in (*graph.value_info, *graph.output)}
    moved = 0
    for slot in candidates:
        node = graph.node[slot]
        operator, kept, without_rank = _MOVED[node.op_type]
        if node.output[0] not in outputs and kept(node, read):
            continue
        elem_type, dims = read.shape(node.input[0]) or (0, None)
        if dims is None and not without_rank:
            continue
        if dims is not None and node.output[0] not in declared:
            # the input's rank and type: the engine infers no type through an ATen node
            graph.value_info.append(
                onnx.helper.make_tensor_value_info(node.output[0], elem_type, [None] * len(dims))
            )
        graph.node[slot].CopyFrom(
            onnx.helper.make_node(
                "ATen",
                [node.input[0]],
                [node.output[0]],
                name=node.name or f"{operator}_{slot}",
                domain=ATEN_DOMAIN,
                operator=operator,
                overload_name="",
            )
        )
        moved += 1
    if moved:
        import_domain(model, ATEN_DOMAIN)
    return moved


def _pass(exported: Any, _options: Mapping[str, Any]) -> None:
    saturating_tails_to_pytorch(exported.model)


# before the ATen pass (40), which prepares every ATen node for the engine
register_post_export_pass("saturating_tails", _pass, order=38)
