"""``bitsandbytes::gemm_4bit`` called directly (no autograd): refused with what to do instead.

``bnb.matmul_4bit`` skips ``MatMul4Bit`` and calls the ``gemm_4bit`` operator when neither the
input nor the bias needs a gradient (in a LoRA model: the first layers, whose input comes from
the frozen embedding). Traced that way, the weight's scales become graph inputs named after
state-dict entries (``...weight.absmax``) that are neither parameters nor buffers, which the
runtime cannot feed. The symbolic below stops the export with a message; ORTModule's fallback
policy then decides whether PyTorch runs the model.
"""

from __future__ import annotations

from typing import Any

from ortmodule_exporter.errors import ExportError

__all__ = [
    "GEMM_4BIT",
    "GEMM_4BIT_MESSAGE",
    "GEMV_4BIT",
    "GEMV_4BIT_MESSAGE",
    "refuse_gemm_4bit",
    "refuse_gemv_4bit",
]

GEMM_4BIT = "bitsandbytes::gemm_4bit"
GEMV_4BIT = "bitsandbytes::gemv_4bit"

GEMM_4BIT_MESSAGE = (
    "ORTModule cannot export bitsandbytes::gemm_4bit: bitsandbytes calls it instead of "
    "MatMul4Bit when the input of a 4-bit layer does not require grad (here the layers before "
    "the first trainable parameter). Make the model's inputs to those layers require grad, as "
    "peft's prepare_model_for_kbit_training does: call model.enable_input_require_grads() on a "
    "Hugging Face model, or register a forward hook on the embedding that calls "
    "output.requires_grad_(True). Then every 4-bit matmul exports as MatMulBnb4."
)


def refuse_gemm_4bit(g: Any, *args: Any) -> Any:
    raise ExportError(GEMM_4BIT_MESSAGE, op=GEMM_4BIT)


GEMV_4BIT_MESSAGE = (
    "ORTModule cannot export bitsandbytes::gemv_4bit: in eval mode, with an input that needs no "
    "gradient, bnb.nn.Linear4bit on a CPU with AVX512-BF16 repacks its weight in place for "
    "bitsandbytes' own inference kernel, a layout the engine's MatMulBnb4 does not read. Run "
    "inference of this model in PyTorch (ORTMODULE_FALLBACK_POLICY lets ORTModule do it), or "
    "keep the layers in train mode. Note that the repacking changes the module's weights "
    "for good: a model that went through it trains under ORTModule on the generic PythonOp route."
)


def refuse_gemv_4bit(g: Any, *args: Any) -> Any:
    raise ExportError(GEMV_4BIT_MESSAGE, op=GEMV_4BIT)
