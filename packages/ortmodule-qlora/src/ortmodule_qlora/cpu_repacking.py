"""bitsandbytes' eval-mode weight repacking for its AVX512-BF16 CPU kernel, refused with what to
do before torch.onnx reaches ``gemv_4bit``.

On a CPU with AVX512-BF16, ``bnb.nn.Linear4bit.forward`` in eval mode, for an input that needs
no gradient, first repacks its weight (``bitsandbytes.functional._convert_weight_packed_for_cpu``:
shifts and bitwise ANDs on the packed bytes) and then calls ``gemv_4bit`` on that layout. Traced,
the repacking is part of the graph, and torch.onnx's symbolic for its bitwise AND fails first
("ONNX export does NOT support exporting bitwise AND for non-boolean input values"), so the
refusal of :func:`ortmodule_qlora.gemm_4bit.export_gemv_4bit`, which says what to do, was never
reached. This layer refuses the AND that the repacking traced with the same message; every other
AND keeps its symbolic.

>>> from ortmodule_exporter.symbolics.registry import register_symbolic_layer
>>> register_symbolic_layer(LAYER, repacking_layer, order=40)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ortmodule_exporter.errors import ExportError
from ortmodule_exporter.symbolics.registry import LayerSymbolic, over_below, torch_symbolic

from .gemm_4bit import GEMV_4BIT, GEMV_PACKED_MESSAGE

__all__ = ["LAYER", "repacking_layer"]

LAYER = "qlora_cpu_repacking"

#: the bitsandbytes function whose traced ops are the repacking (read from the node's stack)
_REPACKING = "_convert_weight_packed_for_cpu"


def _and(default: Callable[..., Any], g: Any, *args: Any) -> Any:
    node = getattr(g, "original_node", None)
    source = node.sourceRange() if node is not None else ""
    if _REPACKING in source:
        raise ExportError(GEMV_PACKED_MESSAGE, op=GEMV_4BIT)
    return default(g, *args)


def repacking_layer(_config: Any) -> Iterator[LayerSymbolic]:
    """The symbolic layer: ``aten::__and_`` (``bitwise_and``) over PyTorch's own."""
    yield LayerSymbolic("aten::__and_", over_below(_and, torch_symbolic(9, "__and_")), 9)
