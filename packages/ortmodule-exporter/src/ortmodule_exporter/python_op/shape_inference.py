"""Real output dims for PythonOp nodes: shape functions registered per Function.

Without one, a PythonOp output keeps only its rank. The post-export pass
``python_op_shapes`` (:mod:`ortmodule_exporter.passes.python_op`) calls
:func:`infer_python_op_shapes`.

>>> from ortmodule_exporter.python_op import register_shape_inference
>>> register_shape_inference("my_pkg.ops.Gelu", lambda shapes, dtypes: [shapes[0]])
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import onnx

from ..onnx_graph import attribute
from .registry import PYTHON_OP_DOMAIN, REGISTRY, RefusedPythonOpError, _func_name, qualified_name

logger = logging.getLogger("ortmodule.exporter")

#: ``fn(input_shapes, input_dtypes) -> output_shapes``: shapes are lists of ``int`` (static),
#: ``str`` (a symbolic dim) or ``None`` (unknown), one per tensor input/output; dtypes are ONNX
#: element types. A shape may itself be ``None`` when the input's rank is unknown.
ShapeFn = Callable[
    [list[list[int | str | None] | None], list[int]], Sequence[Sequence[int | str | None] | None]
]


# -- shape inference ---------------------------------------------------------------------------

_SHAPE_FNS: dict[str, ShapeFn] = {}
_SHAPE_FNS_BY_CLASS: dict[type, ShapeFn] = {}


def register_shape_inference(func: str | type, fn: ShapeFn) -> None:
    """Give a Function's PythonOp outputs real dims instead of rank-only unknown ones.

    ``func`` is the Function class or its qualified name. ``fn(input_shapes, input_dtypes)``
    returns one shape per tensor output (see :data:`ShapeFn`); dims that are strings are the
    model's symbolic dims, so a pass-through keeps ``batch`` and ``seq`` known downstream.

    >>> register_shape_inference("my_pkg.ops.ScaledGelu", lambda shapes, dtypes: [shapes[0]])
    """
    if not callable(fn):
        raise TypeError("register_shape_inference: fn must be callable")
    if isinstance(func, str):
        _SHAPE_FNS[func] = fn
    else:
        _SHAPE_FNS_BY_CLASS[func] = fn


def unregister_shape_inference(func: str | type) -> None:
    if isinstance(func, str):
        _SHAPE_FNS.pop(func, None)
    else:
        _SHAPE_FNS_BY_CLASS.pop(func, None)


def _shape_fn(func_name: str) -> ShapeFn | None:
    try:
        entry = REGISTRY.lookup(func_name)
    except RefusedPythonOpError:
        return _SHAPE_FNS.get(func_name)
    fn = _SHAPE_FNS_BY_CLASS.get(entry.cls)
    return fn if fn is not None else _SHAPE_FNS.get(qualified_name(entry.cls))


def _dims(vi: onnx.ValueInfoProto | None) -> list[int | str | None] | None:
    if vi is None or not vi.type.tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def _set_value_info(
    graph: onnx.GraphProto, name: str, elem_type: int, dims: Sequence[int | str | None]
) -> None:
    for vi in list(graph.value_info):
        if vi.name == name:
            graph.value_info.remove(vi)
    shape = [d if d is not None else None for d in dims]
    graph.value_info.append(onnx.helper.make_tensor_value_info(name, elem_type, shape))


def infer_python_op_shapes(model: onnx.ModelProto) -> int:
    """Write the output dims of every PythonOp whose Function has a shape function.

    Returns how many nodes got dims. Without a shape function an output keeps its rank only.
    """
    graph = model.graph
    todo = [n for n in graph.node if n.domain == PYTHON_OP_DOMAIN and n.op_type == "PythonOp"]
    todo = [(n, fn) for n in todo if (fn := _shape_fn(_func_name(n))) is not None]
    done = 0
    for node, fn in todo:
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        except Exception:  # noqa: BLE001 - shapes are an optimisation, never a failed export
            return done
        known = {
            vi.name: vi
            for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output)
        }
        in_shapes = [_dims(known.get(name)) for name in node.input]
        in_types = list(attribute(node, "input_tensor_types") or [])
        out_types = list(attribute(node, "output_tensor_types") or [])
        try:
            shapes = list(fn(in_shapes, in_types))
        except Exception as err:  # noqa: BLE001
            logger.warning(
                "shape function of %s failed (%s); its outputs keep their rank only",
                _func_name(node),
                err,
            )
            continue
        for name, shape, elem_type in zip(node.output[1:], shapes, out_types, strict=False):
            if shape is not None and name:
                _set_value_info(graph, name, elem_type, shape)
        done += 1
    return done
