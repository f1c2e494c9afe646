"""Export bitsandbytes' ``MatMul4Bit`` as the engine's native ``com.microsoft::MatMulBnb4``.

``bnb.nn.Linear4bit`` (and ``bnb.matmul_4bit``) call ``MatMul4Bit.apply(A, B, out, bias,
quant_state)`` whenever the input or the bias needs a gradient. The generic route exports that
call as a PythonOp, whose PyTorch backward keeps copies of the tensors ``MatMul4Bit`` saves; the
native node lets the engine run and differentiate the 4-bit matmul itself. The frozen weight
gets no gradient. Calls the node cannot express (a bf16 input, fp16 on CPU, an ``out=`` tensor, a
weight layout listed in :mod:`ortmodule_qlora.quant_state`) keep the generic PythonOp route,
which runs bitsandbytes' own code, so they train with correct numbers, only slower.

>>> from ortmodule_exporter.python_op import register_python_op_exporter
>>> register_python_op_exporter(MATMUL_4BIT, export_matmul_4bit)
>>> use_matmul_bnb4(False)   # the generic PythonOp route, e.g. to compare the two
>>> use_matmul_bnb4(True)
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .quant_state import Bnb4Layout, UnsupportedQuantState, engine_layout

__all__ = [
    "MATMUL_4BIT",
    "MATMUL_BNB4",
    "export_matmul_4bit",
    "matmul_bnb4",
    "matmul_bnb4_enabled",
    "use_matmul_bnb4",
]

logger = logging.getLogger("ortmodule.qlora")

MATMUL_4BIT = "bitsandbytes.autograd._functions.MatMul4Bit"
MATMUL_BNB4 = "com.microsoft::MatMulBnb4"

_ENABLED = [True]


def use_matmul_bnb4(enabled: bool = True) -> None:
    """Export ``MatMul4Bit`` as ``MatMulBnb4`` (default) or as a generic PythonOp.

    It applies to exports from now on; a graph already built keeps its route.
    """
    _ENABLED[0] = bool(enabled)


def matmul_bnb4_enabled() -> bool:
    return _ENABLED[0]


def _scalar_type(value: Any) -> str | None:
    value_type = value.type()
    return value_type.scalarType() if hasattr(value_type, "scalarType") else None


_DTYPES = {"Float": torch.float32, "Half": torch.float16}


def _reason_not_native(a: Any, out: Any, quant_state: Any) -> str | None:
    if out is not None:
        return "it writes into an out= tensor"
    scalar = _scalar_type(a)
    if scalar not in _DTYPES:
        return f"its input is {scalar}; MatMulBnb4 takes float32 or float16"
    if scalar == "Half" and quant_state.absmax.device.type == "cpu":
        return "its input is float16 and the engine's CPU MatMulBnb4 takes float32 only"
    return None


def export_matmul_4bit(
    g: Any, node: Any, a: Any, b: Any, out: Any, bias: Any, quant_state: Any
) -> Any | None:
    """The ``MatMul4Bit`` handler: ``MatMulBnb4`` (+ ``Add`` for the bias), or ``None``."""
    if not _ENABLED[0]:
        return None
    reason = _reason_not_native(a, out, quant_state)
    if reason is None:
        try:
            layout = engine_layout(quant_state)
        except UnsupportedQuantState as err:
            reason = str(err)
    if reason is not None:
        logger.info("MatMul4Bit exported as a PythonOp, not MatMulBnb4: %s", reason)
        return None
    y = matmul_bnb4(g, a, b, layout, _DTYPES[_scalar_type(a) or "Float"], bias)
    result = next(iter(node.outputs()))
    y.setType(result.type())
    return y


def matmul_bnb4(
    g: Any, a: Any, b: Any, layout: Bnb4Layout, dtype: torch.dtype, bias: Any = None
) -> Any:
    """``a @ W.T (+ bias)`` as one ``MatMulBnb4`` node, ``W`` the 4-bit weight ``b`` packs.

    The scales are a ``Constant`` in ``dtype``: the weight is frozen, its scales never change.
    """
    # B arrives as [(N*K+1)//2, 1]; the engine reads the packed bytes as one flat vector
    flat = g.op("Reshape", b, g.op("Constant", value_t=torch.tensor([-1], dtype=torch.int64)))
    absmax = g.op("Constant", value_t=layout.absmax.to(dtype))
    y = g.op(
        MATMUL_BNB4,
        a,
        flat,
        absmax,
        K_i=layout.K,
        N_i=layout.N,
        block_size_i=layout.block_size,
        quant_type_i=layout.quant_type,
        training_mode_i=1,
        transB_i=1,
    )
    if bias is not None:
        y = g.op("Add", y, bias)
    return y
