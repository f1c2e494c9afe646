"""The ``qlora`` component: announced through the ``ortmodule.components`` entry point.

``register()`` installs the ``MatMul4Bit`` -> ``MatMulBnb4`` exporter, the refusals (with what to
do) of direct ``bitsandbytes::gemm_4bit`` / ``gemv_4bit`` calls and the CPU backward rewrite, only when bitsandbytes imports;
otherwise ``check()`` says why the component is idle.

>>> from ortmodule_exporter.components import register_component
>>> register_component(COMPONENT)      # what ORTModule's load_components() does
"""

from __future__ import annotations

from ortmodule_exporter.components import Component
from ortmodule_exporter.passes.built_graph import register_built_graph_pass
from ortmodule_exporter.python_op import register_python_op_exporter
from ortmodule_exporter.symbolics.registry import register_symbolic

from .backward_rewrite import rewrite_matmul_bnb4_backward
from .gemm_4bit import GEMM_4BIT, GEMV_4BIT, refuse_gemm_4bit, refuse_gemv_4bit
from .matmul_bnb4 import MATMUL_4BIT, export_matmul_4bit

__all__ = ["BACKWARD_PASS", "COMPONENT", "check", "register"]

BACKWARD_PASS = "qlora_matmul_bnb4_backward"


def check() -> str | None:
    """``None`` when bitsandbytes is importable, else what to install."""
    try:
        import bitsandbytes  # noqa: F401
    except Exception as err:  # bitsandbytes raises more than ImportError on odd machines
        return (
            f"bitsandbytes cannot be imported ({type(err).__name__}: {err}); "
            "install it with `pip install 'ortmodule-qlora[bnb]'`"
        )
    return None


def register() -> None:
    if check() is not None:
        return
    register_python_op_exporter(MATMUL_4BIT, export_matmul_4bit)
    register_symbolic(GEMM_4BIT, refuse_gemm_4bit, 1)
    register_symbolic(GEMV_4BIT, refuse_gemv_4bit, 1)
    register_built_graph_pass(BACKWARD_PASS, rewrite_matmul_bnb4_backward, order=50)


COMPONENT = Component(
    name="ortmodule-qlora",
    version="0.1.0",
    register=register,
    check=check,
    summary="bitsandbytes 4-bit matmuls (QLoRA) run as the engine's MatMulBnb4",
)
