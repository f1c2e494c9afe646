"""QLoRA for ORTModule: bitsandbytes' 4-bit matmul exported as the engine's ``MatMulBnb4``.

Installed, the package is found by ORTModule through its ``ortmodule.components`` entry point;
nothing needs importing. To compare with the generic PythonOp route:

>>> from ortmodule_qlora import use_matmul_bnb4
>>> use_matmul_bnb4(False)
>>> use_matmul_bnb4(True)
"""

from .backward_rewrite import rewrite_matmul_bnb4_backward
from .component import COMPONENT
from .matmul_bnb4 import MATMUL_4BIT, export_matmul_4bit, matmul_bnb4_enabled, use_matmul_bnb4
from .quant_state import Bnb4Layout, UnsupportedQuantState, engine_layout

__version__ = "0.1.0"

__all__ = [
    "COMPONENT",
    "MATMUL_4BIT",
    "Bnb4Layout",
    "UnsupportedQuantState",
    "engine_layout",
    "export_matmul_4bit",
    "matmul_bnb4_enabled",
    "rewrite_matmul_bnb4_backward",
    "use_matmul_bnb4",
]
