"""The sizes a trace saw are one example: the ONNX conversion must not take them as facts.

The TorchScript tracer types every value with the concrete sizes of the traced call. The ONNX
conversion replaces each type with what ONNX shape inference derives from the graph inputs'
symbolic dims, but where inference gives no rank (a ``Reshape`` to a computed shape of unknown
length, an operator it does not know) it keeps the traced sizes, and then folds any ``Shape``
read of that value (``x.size(0)``) into a constant: the graph bakes the traced size and fails in a
``Reshape`` (or, through ``Expand`` or ``ConstantOfShape``, gives the wrong shape) on the next
call with another size. ``torch.nn.MultiheadAttention`` hits it: its packed projection goes
through ``unsqueeze(0).transpose(0, -2).squeeze(-2)`` and then ``k.view(k.shape[0], ...)``.

:func:`sizes_left_to_inference` keeps each value's rank and dtype but forgets its traced sizes
before the conversion, so a size is a constant only where inference proves it is.

>>> import torch
>>> with sizes_left_to_inference():
...     pass
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["forget_traced_sizes", "sizes_left_to_inference"]


def forget_traced_sizes(graph: Any) -> None:
    """Every tensor value a node of ``graph`` computes: sizes unknown, rank and dtype kept.
    Graph inputs keep theirs (the exporter marks the user's dims dynamic; parameters are
    fixed)."""
    blocks = [graph]
    while blocks:
        block = blocks.pop()
        for node in block.nodes():
            blocks.extend(node.blocks())
            for value in node.outputs():
                t = value.type()
                if not isinstance(t, torch._C.TensorType):
                    continue
                sizes = t.varyingSizes()
                if sizes is None or all(s is None for s in sizes):
                    continue
                value.setType(t.with_sizes([None] * len(sizes)))


@contextmanager
def sizes_left_to_inference(enabled: bool = True) -> Iterator[None]:
    """For one export (the exporter holds the symbolic registry's lock around it): the ONNX
    conversion starts from a graph whose computed values have no traced sizes. Not
    ``enabled`` (a static-shape export), nothing changes."""
    if not enabled:
        yield
        return
    convert = torch._C._jit_pass_onnx

    def converting(graph: Any, operator_export_type: Any) -> Any:
        forget_traced_sizes(graph)
        return convert(graph, operator_export_type)

    # torch.onnx calls it as ``_C._jit_pass_onnx`` (an attribute of torch._C, looked up at the
    # call), right after it marks the graph inputs' dims dynamic
    torch._C._jit_pass_onnx = converting
    try:
        yield
    finally:
        torch._C._jit_pass_onnx = convert
