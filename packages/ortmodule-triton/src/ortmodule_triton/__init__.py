"""ONNX subgraphs of ORTModule's training graph as generated Triton kernels.

>>> from ortmodule_triton import compile_subgraph, supported_ops
>>> ("", "Softmax") in supported_ops()
True

Importing this package imports neither triton nor the engine.
"""

from .codegen import KernelPlan, generate
from .errors import TritonCodegenError, TritonConfigError
from .fusion_config import FusionConfig, load_config, parse_config
from .graph_pass import last_report, register_triton_pass, triton_pass, unregister_triton_pass
from .kernel import CompiledSubgraph, LaunchConfig, compile_subgraph
from .ops import supported_ops
from .options import TritonOptions
from .partition import Subgraph, find_subgraphs
from .verification import verification_mode

__version__ = "0.1.0"

__all__ = [
    "CompiledSubgraph",
    "FusionConfig",
    "KernelPlan",
    "LaunchConfig",
    "Subgraph",
    "TritonCodegenError",
    "TritonConfigError",
    "TritonOptions",
    "compile_subgraph",
    "find_subgraphs",
    "generate",
    "last_report",
    "load_config",
    "parse_config",
    "register_triton_pass",
    "supported_ops",
    "triton_pass",
    "unregister_triton_pass",
    "verification_mode",
]
