"""ONNX subgraphs of ORTModule's training graph as generated Triton kernels.

>>> from ortmodule_triton import compile_subgraph, supported_ops
>>> ("", "Softmax") in supported_ops()
True
"""

from .codegen import KernelPlan, generate
from .errors import TritonCodegenError, TritonConfigError
from .kernel import CompiledSubgraph, LaunchConfig, compile_subgraph
from .ops import supported_ops

__version__ = "0.1.0"

__all__ = [
    "CompiledSubgraph",
    "KernelPlan",
    "LaunchConfig",
    "TritonCodegenError",
    "TritonConfigError",
    "compile_subgraph",
    "generate",
    "supported_ops",
]
