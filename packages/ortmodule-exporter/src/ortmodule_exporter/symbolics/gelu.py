"""The ``gelu`` symbolic from opset 20 (below it PyTorch's default export trains as it is)."""

from __future__ import annotations

from typing import Any

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import Value

# -- gelu ------------------------------------------------------------------------------------


@sh.parse_args("v", "s")
def gelu(g: Any, x: Value, approximate: str = "none") -> Value:
    # From opset 20 the default export is ONNX Gelu, and the engine differentiates every Gelu
    # node with the exact (erf) formula, also approximate="tanh" ones. FastGelu is the tanh
    # formula with its own gradient. (Below opset 20 the default decomposition is correct.)
    if approximate == "tanh":
        return g.op("com.microsoft::FastGelu", x)
    return g.op("Gelu", x)
