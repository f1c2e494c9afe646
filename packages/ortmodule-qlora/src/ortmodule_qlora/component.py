"""The ``qlora`` component: announced through the ``ortmodule.components`` entry point.

``register()`` installs the ``MatMul4Bit`` -> ``MatMulBnb4`` exporter, the ``bitsandbytes::gemm_4bit``
/ ``gemv_4bit`` -> ``MatMulBnb4`` symbolics and the CPU backward rewrite when
bitsandbytes is installed, without importing it; otherwise ``check()`` says why the component is
idle.

>>> from ortmodule_exporter.components import register_component
>>> register_component(COMPONENT)      # what ORTModule's load_components() does
"""

from __future__ import annotations

import importlib.util

from ortmodule_exporter.components import Component
from ortmodule_exporter.passes.built_graph import register_built_graph_pass
from ortmodule_exporter.python_op import register_python_op_exporter
from ortmodule_exporter.symbolics.registry import register_symbolic, register_symbolic_layer

from .backward_rewrite import rewrite_matmul_bnb4_backward
from .cpu_repacking import LAYER, repacking_layer
from .gemm_4bit import GEMM_4BIT, GEMV_4BIT, export_gemm_4bit, export_gemv_4bit
from .matmul_bnb4 import MATMUL_4BIT, export_matmul_4bit

__all__ = ["BACKWARD_PASS", "COMPONENT", "check", "register"]

BACKWARD_PASS = "qlora_matmul_bnb4_backward"


def check() -> str | None:
    """``None`` when bitsandbytes is installed, else what to install.

    Only looks the package up: importing bitsandbytes costs seconds (it compiles kernels with
    ``torch.compile`` at import), and a model with 4-bit layers has imported it already.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed; install it with `pip install 'ortmodule-qlora[bnb]'`"
    return None


def register() -> None:
    # Registration names bitsandbytes' Function and operators by string and imports nothing of
    # it: the exporters run only when a traced model calls them, i.e. after the user imported
    # bitsandbytes to build the model.
    if check() is not None:
        return
    register_python_op_exporter(MATMUL_4BIT, export_matmul_4bit)
    register_symbolic(GEMM_4BIT, export_gemm_4bit, 1)
    register_symbolic(GEMV_4BIT, export_gemv_4bit, 1)
    register_symbolic_layer(LAYER, repacking_layer, order=40)
    register_built_graph_pass(BACKWARD_PASS, rewrite_matmul_bnb4_backward, order=50)


COMPONENT = Component(
    name="ortmodule-qlora",
    version="0.1.0",
    register=register,
    check=check,
    summary="bitsandbytes 4-bit matmuls (QLoRA) run as the engine's MatMulBnb4",
)
