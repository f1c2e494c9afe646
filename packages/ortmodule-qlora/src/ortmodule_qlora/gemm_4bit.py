"""bitsandbytes' ``gemm_4bit`` / ``gemv_4bit`` operators exported as the engine's ``MatMulBnb4``.

``bnb.matmul_4bit`` (what ``bnb.nn.Linear4bit`` calls) skips ``MatMul4Bit`` and calls the
``bitsandbytes::gemm_4bit`` operator when neither the input nor the bias needs a gradient: in a
LoRA model, the 4-bit layers before the first trainable parameter (their input comes from the
frozen embedding). The operator takes the weight's scales as tensors; traced, they are graph
inputs named after state-dict entries (``...weight.absmax``) that are neither parameters nor
buffers. The symbolic reads their numbers at export
(:func:`ortmodule_exporter.symbolics.traced_state.traced_tensor`) and emits the node
:func:`ortmodule_qlora.matmul_bnb4.matmul_bnb4` builds for ``MatMul4Bit``, scales as a
``Constant``, so those inputs leave the graph. No gradient flows through it: its input needs
none and the weight is frozen. ``use_matmul_bnb4(False)`` does not apply here: the operator has
no autograd Function to run as a PythonOp.

``bitsandbytes::gemv_4bit`` (``bnb.functional.gemv_4bit``) takes the same route where its
kernel reads the usual layout. On a CPU with AVX512-BF16, bitsandbytes registers a CPU kernel
that reads the layout ``Linear4bit`` repacks its weight into in eval mode
(``packing_format_for_cpu``), which MatMulBnb4 does not read; that call, and any the node cannot
express (bfloat16 input, float16 on CPU, a layout listed in :mod:`ortmodule_qlora.quant_state`,
scales computed in the graph), stops the export with a message saying what to do.

>>> from ortmodule_exporter.symbolics.registry import register_symbolic
>>> register_symbolic(GEMM_4BIT, export_gemm_4bit)
"""

from __future__ import annotations

from typing import Any

import torch

from ortmodule_exporter.errors import ExportError
from ortmodule_exporter.symbolics.traced_state import traced_tensor
from ortmodule_exporter.torchscript_onnx import symbolic_helper as sh

from .matmul_bnb4 import matmul_bnb4
from .quant_state import UnsupportedQuantState, operand_layout

__all__ = [
    "GEMM_4BIT",
    "GEMV_4BIT",
    "GEMV_PACKED_MESSAGE",
    "export_gemm_4bit",
    "export_gemv_4bit",
]

GEMM_4BIT = "bitsandbytes::gemm_4bit"
GEMV_4BIT = "bitsandbytes::gemv_4bit"

_DTYPES = {"Float": torch.float32, "Half": torch.float16}

_WORKAROUND = (
    "Make the input of that layer require grad, so bitsandbytes calls MatMul4Bit instead (its "
    "unsupported cases run bitsandbytes' own code as a PythonOp): call "
    "model.enable_input_require_grads() on a Hugging Face model, or register a forward hook on "
    "the embedding that calls output.requires_grad_(True)."
)

GEMV_PACKED_MESSAGE = (
    "ORTModule cannot export bitsandbytes::gemv_4bit on this CPU: with AVX512-BF16, "
    "bitsandbytes' CPU kernel reads the layout bnb.nn.Linear4bit repacks its weight into in "
    "eval mode when the input needs no gradient, a layout the engine's MatMulBnb4 does not read. "
    "Run inference of this model in PyTorch (ORTMODULE_FALLBACK_POLICY lets ORTModule do it), or "
    "keep the layers in train mode. Note that the repacking changes the module's weights "
    "for good: a model that went through it trains under ORTModule on the generic PythonOp route."
)


def _refuse(op: str, why: str) -> ExportError:
    return ExportError(
        f"ORTModule cannot export {op} as MatMulBnb4: {why}. bitsandbytes calls this operator "
        f"instead of MatMul4Bit when the input of a 4-bit layer does not require grad. "
        f"{_WORKAROUND}",
        op=op,
    )


def _tensor(op: str, value: Any, what: str) -> torch.Tensor:
    tensor = traced_tensor(value)
    if tensor is None:
        raise _refuse(op, f"its {what} are computed in the graph, not read from the model")
    return tensor


def _dtype(op: str, a: Any, scales: torch.Tensor) -> torch.dtype:
    value_type = a.type()
    name = value_type.scalarType() if hasattr(value_type, "scalarType") else None
    if name not in _DTYPES:
        raise _refuse(op, f"its input is {name}; MatMulBnb4 takes float32 or float16")
    if name == "Half" and scales.device.type == "cpu":
        raise _refuse(op, "its input is float16 and the engine's CPU MatMulBnb4 takes float32 only")
    return _DTYPES[name]


def _emit(g: Any, op: str, a: Any, b: Any, layout_of: Any, scales: torch.Tensor, bias: Any) -> Any:
    dtype = _dtype(op, a, scales)
    try:
        layout = layout_of()
    except UnsupportedQuantState as err:
        raise _refuse(op, str(err)) from err
    y = matmul_bnb4(g, a, b, layout, dtype, bias)
    original = getattr(g, "original_node", None)
    if original is not None:
        y.setType(original.output().type())
    return y


def export_gemm_4bit(
    g: Any,
    a: Any,
    b: Any,
    shape: Any,
    absmax: Any,
    blocksize: Any,
    quant_type: Any,
    bias: Any = None,
    absmax_8bit: Any = None,
    absmax_code: Any = None,
    absmax_offset: Any = None,
) -> Any:
    """The ``gemm_4bit`` symbolic: ``MatMulBnb4`` (+ ``Add`` for the bias), or an ExportError."""
    op = GEMM_4BIT
    scales = _tensor(op, absmax, "scales")
    nested = [
        None if v is None or sh._is_none(v) else _tensor(op, v, "scales")
        for v in (absmax_8bit, absmax_code, absmax_offset)
    ]

    def layout_of() -> Any:
        return operand_layout(
            tuple(sh._parse_arg(shape, "is")),
            str(sh._parse_arg(quant_type, "s")),
            int(sh._parse_arg(blocksize, "i")),
            scales,
            *nested,
        )

    bias = None if bias is None or sh._is_none(bias) else bias
    return _emit(g, op, a, b, layout_of, scales, bias)


def export_gemv_4bit(
    g: Any, a: Any, b: Any, shape: Any, absmax: Any, code: Any, blocksize: Any
) -> Any:
    """The ``gemv_4bit`` symbolic: ``MatMulBnb4``, or an ExportError saying what to do."""
    op = GEMV_4BIT
    device = a.type().device() if hasattr(a.type(), "device") else None
    if device is None or device.type == "cpu":  # decided before reading the scales: their layout
        from bitsandbytes.functional import has_avx512bf16

        if has_avx512bf16():  # type: ignore[no-untyped-call]
            raise ExportError(GEMV_PACKED_MESSAGE, op=op)
    scales = _tensor(op, absmax, "scales")
    table = _tensor(op, code, "code table")
    # how bitsandbytes' own kernels tell the two 4-bit types apart
    quant = "fp4" if float(table[1]) > 0 else "nf4"

    def layout_of() -> Any:
        return operand_layout(
            tuple(sh._parse_arg(shape, "is")), quant, int(sh._parse_arg(blocksize, "i")), scales
        )

    return _emit(g, op, a, b, layout_of, scales, None)
