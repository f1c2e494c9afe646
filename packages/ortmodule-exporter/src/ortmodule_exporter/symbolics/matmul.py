"""``matmul`` symbolic: a vector times a matrix or a batch of them as 1-row matrices."""

from __future__ import annotations

from typing import Any

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import Value, _squeeze, _unsqueeze

# -- matmul ----------------------------------------------------------------------------------


def matmul(g: Any, a: Value, b: Value) -> Value:
    # ONNX MatMul takes a 1-D left operand as numpy does, but the engine's MatMul gradient for
    # a 1-D left operand and a right one of rank 3 or more multiplies the (..., m) output
    # gradient by b's transpose as if both were plain matrices and sums: a's gradient came back
    # several units off (found by the differential fuzzer). A (1, k) row gives the same product
    # and takes the batched gradient the engine gets right; the other ranks export as they are.
    # Against a matrix too: where the graph knows no rank for b (a Slice's output), the engine's
    # gradient took b's as the dot product of the two vectors (a (1,)-shaped scalar, then a
    # Reshape to b's shape failed: found by the differential fuzzer, seed 4416).
    if sh._get_tensor_rank(a) == 1 and (sh._get_tensor_rank(b) or 0) >= 2:
        return _squeeze(g, g.op("MatMul", _unsqueeze(g, a, [0]), b), [-2])
    return g.op("MatMul", a, b)
