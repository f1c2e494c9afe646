"""Checks of exported models: every PythonOp must call a Function this process exported.

A model loaded from a file or the export cache that names anything else is refused
(:func:`check_model`); :func:`model_is_runnable` turns that into a cache miss.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx

from ..onnx_graph import attribute
from .registry import PYTHON_OP_DOMAIN, REGISTRY, RefusedPythonOpError, _func_name

# -- checks and passes on exported models -------------------------------------------------------


def _python_op_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        if node.domain == PYTHON_OP_DOMAIN and node.op_type in ("PythonOp", "PythonOpGrad"):
            yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _python_op_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    yield from _python_op_nodes(sub)


def check_model(model: onnx.ModelProto) -> None:
    """Refuse a model with a PythonOp that this process did not export.

    Every PythonOp must name a Function registered by our export in this process and carry only
    the object references that export produced. Raises :class:`RefusedPythonOpError` otherwise.
    """
    for node in _python_op_nodes(model.graph):
        name = _func_name(node)
        REGISTRY.lookup(name)
        pointers = list(attribute(node, "input_pointer_scalars") or [])
        if node.op_type == "PythonOp" and not REGISTRY.knows_node(name, pointers):
            raise RefusedPythonOpError(
                f"PythonOp refused: node {node.name!r} calls {name} with object references "
                "that ORTModule did not export in this process (a model from a file or from the "
                "export cache of another run). Re-export the module, or clear ORTMODULE_CACHE_DIR."
            )


def model_is_runnable(model: onnx.ModelProto) -> bool:
    """Whether :func:`check_model` accepts ``model`` (a cache hit that fails is a miss)."""
    try:
        check_model(model)
    except RefusedPythonOpError:
        return False
    return True
