"""``repeat_interleave`` symbolic: PyTorch's, given a constant ``dim`` of its own.

PyTorch's symbolic (opsets 9 and 13) reads a constant ``dim`` as the tensor its Constant node
holds and, when negative, adds the rank to it in place (``dim += len(input_sizes)``). The
tracer pools equal constants into one node, so every later operator that reads the same ``-1``
(``stack(dim=-1)``, ``flatten(-2)``, ``cat(dim=-1)``, ...) exports with the mutated value: in
the interleaved rotary embedding (Cohere, Helium, Ernie 4.5, DeepSeek V4:
``freqs.repeat_interleave(2, dim=-1)`` beside ``torch.stack([-x2, x1], dim=-1).flatten(-2)``)
the stack landed on axis 2 and the flatten made a rank-6 tensor, which the engine refused
("[ShapeInferenceError] Incompatible dimensions" at a Where or Mul). Plain
``torch.onnx.export`` writes the same wrong graph. Handing PyTorch a fresh Constant keeps the
mutation on a node nobody else reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.onnx import symbolic_helper as sh
from torch.onnx import symbolic_opset13

from .helpers import Value


def repeat_interleave(
    g: Any, self: Value, repeats: Value, dim: Value = None, output_size: Value = None
) -> Value:
    if dim is not None and not sh._is_none(dim) and sh._is_constant(dim):
        value = int(sh._get_const(dim, "i", "dim"))
        dim = g.op("Constant", value_t=torch.tensor(value, dtype=torch.int64))
    # PyTorch's own from opset 13 (ORTModule exports at 14 or above)
    return symbolic_opset13.repeat_interleave(g, self, repeats, dim, output_size)
