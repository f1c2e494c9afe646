"""Keep a size read from a tensor dynamic when it may come from an input's dynamic dim.

The tracer types every value with the sizes of the example inputs. torch.onnx converts node by
node, running ONNX shape inference on each; where inference cannot work out an output's shape
(a ``Reshape`` whose target is computed, as ``unflatten`` writes it) it keeps the traced type as
if its sizes were facts, and a later ``x.shape[0]`` of such a value is folded into a constant.
``nn.MultiheadAttention``'s ``k.view(k.shape[0], bsz * heads, d)`` became
``Reshape(k, [12, ...])``, which failed on the next sequence length; read as a slice bound, such
a constant gives wrong numbers without failing.

While one export runs, the ``aten::size`` symbolic checks the traced sizes it reads: one equal
to a dim of the example inputs (other than 0 and 1, which the graph keeps fixed), or to the
product of two such dims, may follow the inputs, so the shape is read through a
``ortmodule::SizeOf`` node, which shape inference cannot see through: nothing is folded, and
the engine reads the size from the tensor when the graph runs. A graph input's sizes are left
alone (inference knows the user's inputs' dims as dynamic, and a parameter's as facts). :func:`remove_size_barriers`
drops those nodes from the exported model. Other sizes (a hidden size, a vocabulary) stay
constants, and the traced types stay as they are for the symbolics that read them.

>>> with sizes_kept_dynamic(example_tensors):   # the exporter does this around torch.onnx.export
...     torch.onnx.export(module, ...)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import onnx
import torch

from ..aten.symbolic_helpers import traced_sizes
from ..symbolics.registry import register_symbolic
from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset9

__all__ = ["SIZE_OF", "remove_size_barriers", "sizes_kept_dynamic"]

DOMAIN = "ortmodule"
#: the node that hides a shape from inference (removed after the export)
SIZE_OF = "SizeOf"

_LOCAL = threading.local()


def _input_sizes(tensors: Sequence[torch.Tensor]) -> frozenset[int]:
    dims = {int(size) for t in tensors for size in t.shape if size > 1}
    return frozenset(dims | {a * b for a in dims for b in dims})


@contextlib.contextmanager
def sizes_kept_dynamic(tensors: Sequence[torch.Tensor], enabled: bool = True) -> Iterator[None]:
    """For one export whose inputs are ``tensors``: sizes that may follow them stay dynamic."""
    previous = getattr(_LOCAL, "sizes", None)
    _LOCAL.sizes = _input_sizes(tensors) if enabled else None
    try:
        yield
    finally:
        _LOCAL.sizes = previous


def _may_follow_inputs(value: Any, dim: int | None) -> bool:
    suspect = getattr(_LOCAL, "sizes", None)
    if not suspect or value.node().kind() == "prim::Param":
        # a graph input's sizes are known to inference: dynamic dims for the user's inputs,
        # facts for parameters and buffers (``weight.size(0)`` is the vocabulary)
        return False
    sizes = traced_sizes(value)
    if sizes is None:
        return False
    if dim is not None:
        if not -len(sizes) <= dim < len(sizes):
            return False
        sizes = [sizes[dim]]
    return any(size in suspect for size in sizes if size is not None)


def _size(g: Any, self: Any, dim: Any = None) -> Any:

    index = None if dim is None or sh._is_none(dim) else sh._maybe_get_const(dim, "i")
    if index is not None and not isinstance(index, int):
        return symbolic_opset9.size(g, self, dim)
    if _may_follow_inputs(self, index):
        hidden = g.op(f"{DOMAIN}::{SIZE_OF}", self)
        kind = self.type()
        rank = sh._get_tensor_rank(self)
        if isinstance(kind, torch._C.TensorType) and rank is not None:
            hidden.setType(kind.with_sizes([None] * rank))
        if index is not None and index < 0 and rank is not None:
            dim = g.op("Constant", value_t=torch.tensor(index + rank))
        self = hidden
    return symbolic_opset9.size(g, self, dim)


register_symbolic("aten::size", _size, 9)


def remove_size_barriers(model: onnx.ModelProto) -> None:
    """Drop the ``SizeOf`` nodes of :func:`sizes_kept_dynamic` (each reads its input as is)."""
    graph = model.graph
    barriers = [n for n in graph.node if n.domain == DOMAIN and n.op_type == SIZE_OF]
    if not barriers:
        return
    renamed = {n.output[0]: n.input[0] for n in barriers}
    kept = [n for n in graph.node if not (n.domain == DOMAIN and n.op_type == SIZE_OF)]
    for node in kept:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    for out in graph.output:
        if out.name in renamed:  # pragma: no cover - a size is never a graph output of its own
            raise RuntimeError(f"a SizeOf node feeds the graph output {out.name}")
    del graph.node[:]
    graph.node.extend(kept)
    dropped = set(renamed)
    infos = [v for v in graph.value_info if v.name not in dropped]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    if not any(n.domain == DOMAIN for n in graph.node):
        imports = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(imports)
