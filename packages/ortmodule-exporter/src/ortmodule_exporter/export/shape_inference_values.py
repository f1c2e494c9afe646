"""Keep the weights' values out of torch.onnx's whole-graph shape inference.

torch.onnx's TorchScript exporter (torch 2.13) runs ONNX shape inference over the whole graph
twice (at the end of ``_optimize_graph`` and of ``_model_to_graph``), node by node, handing it
the values of every parameter and buffer. For each node that reads one it copies the value into
a ``Constant`` of a one-node ONNX model, serialises that model and infers its shapes
(``CloneNodeToGraph`` in ``shape_type_inference.cpp``); a ``Transpose`` of a weight is even
computed. On GPT-2 small that copied the 124M parameters (the 154 MB tied embedding twice a
pass) each pass: seconds of the export, for types that the values do not decide.

A value decides a type only where it is read as a shape, an index, a count or a bound; such a
value is small. Inside :func:`large_values_hidden` the two passes see the values of at most
:data:`VALUE_LIMIT` elements; the larger ones are graph inputs of known shape and dtype to them,
as they are to the engine, which feeds their current values on every call. The symbolics
themselves never saw the values (torch.onnx hands them an empty ``params_dict``), so the nodes
of the graph are the same either way.

>>> with large_values_hidden():   # the exporter does this around torch.onnx.export
...     torch.onnx.export(module, ...)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ..torchscript_onnx import export_utils

__all__ = ["VALUE_LIMIT", "large_values_hidden"]

#: the most elements a parameter or buffer may have for shape inference to see its value
#: (a position-ids buffer of 1024 is seen; a 768 x 768 weight is not)
VALUE_LIMIT = 1 << 16

_NAME = "_jit_pass_onnx_graph_shape_type_inference"
_HIDING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "ortmodule_large_values_hidden", default=False
)
_INSTALL_LOCK = threading.Lock()


def _small(params: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: value
        for name, value in params.items()
        if not (hasattr(value, "numel") and value.numel() > VALUE_LIMIT)
    }


def _wrap(infer: Any) -> Any:
    @functools.wraps(infer)
    def shape_type_inference(graph: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if _HIDING.get() and isinstance(params, Mapping):
            params = _small(params)
        return infer(graph, params, *args, **kwargs)

    shape_type_inference._ortmodule_hides_values = True  # type: ignore[attr-defined]
    return shape_type_inference


def _install() -> bool:
    """Wrap the pass once per process, where torch.onnx's exporter looks it up (its ``_C``);
    False when this torch has no such pass (then nothing is hidden)."""
    with _INSTALL_LOCK:
        binding = getattr(export_utils, "_C", None)
        current = getattr(binding, _NAME, None)
        if current is None:  # pragma: no cover - another torch: its inference runs as it is
            return False
        if not getattr(current, "_ortmodule_hides_values", False):
            setattr(binding, _NAME, _wrap(current))
        return True


@contextlib.contextmanager
def large_values_hidden() -> Iterator[None]:
    """torch.onnx's whole-graph shape inference in this context sees no value larger than
    :data:`VALUE_LIMIT` elements (other exports, and other threads, are unchanged)."""
    _install()
    token = _HIDING.set(True)
    try:
        yield
    finally:
        _HIDING.reset(token)
