"""bfloat16 and float16 on the CPU engine: operators it has no kernel for run in PyTorch.

The CPU build of the engine (1.19.2) has bfloat16 kernels only for data movement (Cast,
Reshape, Transpose, Concat, Slice, ...): no Add, MatMul, Gemm, Softmax, LayerNormalization,
Sum or ReduceSum. Its float16 kernels are broader but compute differently from PyTorch's
(PyTorch's CPU kernels for both dtypes compute in float32 and round each result once).
``torch.autocast("cpu", ...)`` and ``model.to(torch.bfloat16)`` put such tensors in the graph,
so every operator that computes on a low-precision tensor on CPU is sent to PyTorch as one ATen
node (an untrainable check): the arithmetic is eager's, operator for operator, and nothing is
silently upcast. What stays in the engine is in :data:`CPU_KERNELS`: operators whose forward
and gradient kernels exist at that dtype and move data without arithmetic. The gradient graph's
own sums of low-precision gradients are handled after the build
(:mod:`ortmodule_exporter.passes.low_precision_sums`).

On CUDA the engine's float16 and bfloat16 kernels are used.

>>> from ortmodule_exporter.aten import low_precision
>>> "Transpose" in low_precision.CPU_KERNELS["BFloat16"]
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .untrainable import register_untrainable_check

__all__ = ["CPU_KERNELS", "LOW_PRECISION", "install", "low_precision_reasons"]

#: the traced scalar types this module handles, and their names in messages
LOW_PRECISION = {"BFloat16": "bfloat16", "Half": "float16"}

#: ONNX operators the CPU engine runs at each low-precision dtype, forward and gradient
#: (checked against the engine by tests/test_low_precision.py). Gather and GatherElements
#: have forward kernels but their gradients (GatherGrad, GatherElementsGrad) have none; Concat
#: and Slice run forward, but their gradient kernels (SplitTraining, SliceGrad) refuse both
#: dtypes when they run ("Split operator does not support BFloat16 yet").
_MOVES = frozenset(
    {
        "Cast",
        "Constant",
        "Flatten",
        "Identity",
        "Reshape",
        "Shape",
        "Split",
        "Squeeze",
        "Transpose",
        "Unsqueeze",
    }
)
CPU_KERNELS: dict[str, frozenset[str]] = {"BFloat16": _MOVES, "Half": _MOVES}


def _scalar(value: Any) -> str | None:
    try:
        return value.type().scalarType()
    except (AttributeError, RuntimeError):
        return None


def _on_cpu(values: Sequence[Any]) -> bool:
    for value in values:
        try:
            device = value.type().device()
        except (AttributeError, RuntimeError):
            continue
        if device is not None:
            return device.type == "cpu"
    return True


def low_precision_reasons(node: Any, inputs: Sequence[Any], emitted: Sequence[Any]) -> list[str]:
    """Reasons to run ``node`` in PyTorch: on CPU it reads or writes a bfloat16 or float16
    tensor, and one of the ONNX nodes ``emitted`` for it has no engine kernel at that dtype.
    Each reason ends in "tensor": it applies to inference exports too."""
    values = [v for v in (*node.inputs(), *node.outputs()) if v is not None]
    dtypes = {s for v in values if (s := _scalar(v)) in LOW_PRECISION}
    if not dtypes or not _on_cpu(values):
        return []
    reasons = []
    for dtype in sorted(dtypes):
        missing = sorted(
            {
                kind.split("::", 1)[1]
                for n in emitted
                if (kind := n.kind()).startswith("onnx::")
                and kind.split("::", 1)[1] not in CPU_KERNELS[dtype]
            }
        )
        if missing:
            reasons.append(
                f"{', '.join(missing)}: no CPU engine kernel for a {LOW_PRECISION[dtype]} tensor"
            )
    return reasons


def install() -> None:
    """Route low-precision CPU operators to PyTorch (done on import of ortmodule_exporter)."""
    register_untrainable_check(low_precision_reasons)
