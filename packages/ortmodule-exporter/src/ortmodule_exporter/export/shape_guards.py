"""Guards on sizes: checked from the input shapes before the graph runs.

Under the TorchScript tracer ``x.shape[i]`` is a traced 0-d tensor, and a forward that turns it
into a Python int (``t.split(d)``, ``range(n)``, ``view(b * h, ...)`` through ``int()``) bakes
the traced size into the graph: on another size the graph fails in a ``Reshape`` or, worse,
runs and gives wrong numbers. Such a guard (see :mod:`.guards`) reads nothing but shapes, so
its value follows from the shapes of the graph inputs alone. :func:`split_shape_guards` turns
each into a :class:`ShapeGuard`, a few shape operations evaluated in Python on the fed inputs'
shapes before the engine runs, instead of a graph output (the engine folds the sizes it knows
into constants, and then cannot build a graph that outputs them).

>>> import numpy as np
>>> ShapeGuard.evaluate_node("Gather", [np.array([2, 5, 8]), np.array(1)], {})
array(5)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch

from ..engine_binding import import_onnxruntime
from ..named_dims import teach_aten_shapes
from .guards import Guard

__all__ = [
    "Dim",
    "ShapeGuard",
    "guard_from_json",
    "guard_to_json",
    "shape_guard_from_json",
    "shape_guard_to_json",
    "split_shape_guards",
]


@dataclass(frozen=True)
class Dim:
    """Dimension ``axis`` of the graph input ``input``, known only when it is fed."""

    input: str
    axis: int


# where a value's dims are kept while a guard is evaluated (apart from the value itself)
_SHAPE_KEY = "shape of "


@dataclass(frozen=True)
class _Step:
    op: str
    inputs: tuple[str, ...]
    output: str
    attrs: tuple[tuple[str, Any], ...]


# the operations a size computation is made of (what the exporter writes for Python int
# arithmetic on traced sizes); anything else keeps the guard a graph output
_SHAPE_OPS = frozenset(
    {
        "Shape",
        "Size",
        "Constant",
        "Gather",
        "Cast",
        "Squeeze",
        "Unsqueeze",
        "Concat",
        "Slice",
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Mod",
        "Neg",
        "Identity",
        "Floor",
        "Ceil",
        "Max",
        "Min",
        "Equal",
        "Less",
        "Greater",
        "Not",
        "ReduceProd",
    }
)


# the steps that only move dims about (an unknown one stays None, read by a later step)
_MOVES_DIMS = frozenset({"Gather", "Squeeze", "Unsqueeze", "Concat", "Slice", "Identity"})


def _unknown(value: Any) -> bool:
    """A computed value holds an unknown dim (None), or is one."""
    array = np.asarray(value)
    return array.dtype == object and any(v is None for v in array.reshape(-1).tolist())


@dataclass(frozen=True)
class ShapeGuard:
    """A guard whose value is computed from input shapes: ``steps`` in graph order."""

    guard: Guard
    steps: tuple[_Step, ...]
    output: str
    #: for each value a ``Shape``/``Size`` reads: its dims, fixed, taken from a fed input or
    #: unknown (None: no guard reads one, :func:`split_shape_guards` checks)
    shapes: tuple[tuple[str, tuple[int | Dim | None, ...]], ...]

    @property
    def inputs(self) -> frozenset[str]:
        """The graph inputs whose fed shape decides the value."""
        return frozenset(d.input for _, dims in self.shapes for d in dims if isinstance(d, Dim))

    def value(self, shape_of: Callable[[str], Sequence[int]]) -> torch.Tensor:
        """The guard's value for inputs of these shapes (``shape_of(input name)``)."""
        values: dict[str, np.ndarray] = {}
        for name, dims in self.shapes:
            known = [shape_of(d.input)[d.axis] if isinstance(d, Dim) else d for d in dims]
            # an unknown dim (None) fails any step that reads it: such a guard stays an output
            values[_SHAPE_KEY + name] = np.array(known, dtype=object if None in known else np.int64)
        for step in self.steps:
            if step.op == "Shape":
                attrs = dict(step.attrs)
                full = values[_SHAPE_KEY + step.inputs[0]]
                values[step.output] = full[attrs.get("start", 0) : attrs.get("end", len(full))]
            elif step.op == "Size":
                size = np.prod(values[_SHAPE_KEY + step.inputs[0]])
                values[step.output] = np.array(int(size), np.int64)
            else:
                args = [values[i] if i else None for i in step.inputs]
                unknown = any(_unknown(a) for i, a in zip(step.inputs, args, strict=True) if i)
                if unknown and step.op not in _MOVES_DIMS:
                    # numpy compares None without failing (None == 1 is False): a guard on
                    # an unknown dim held on the traced shapes and was dropped as a constant
                    raise ValueError(f"{step.op} of a dim shape inference left unknown")
                values[step.output] = self.evaluate_node(step.op, args, dict(step.attrs))
        result = np.asarray(values[self.output])
        if result.dtype == object:
            result = result.astype(np.int64)
        return torch.from_numpy(result.copy()).to(self.guard.value.dtype)

    def holds(self, shape_of: Callable[[str], Sequence[int]]) -> bool:
        return self.guard.holds(self.value(shape_of))

    @staticmethod
    def evaluate_node(op: str, args: list[Any], attrs: Mapping[str, Any]) -> np.ndarray:
        """One shape operation on numpy values, with ONNX semantics."""
        if op == "Constant":
            return np.asarray(attrs["value"])
        a = args[0]
        if op == "Identity":
            return np.asarray(a)
        if op == "Gather":
            return np.take(a, args[1], axis=attrs.get("axis", 0))
        if op == "Cast":
            return np.asarray(a).astype(onnx.helper.tensor_dtype_to_np_dtype(attrs["to"]))
        if op in ("Squeeze", "Unsqueeze"):
            axes = attrs.get("axes")
            if axes is None and len(args) > 1 and args[1] is not None:
                axes = [int(x) for x in np.atleast_1d(args[1])]
            if op == "Squeeze":
                return np.squeeze(a, axis=None if axes is None else tuple(axes))
            out = np.asarray(a)
            wanted = list(axes or ())
            for axis in sorted(x if x >= 0 else x + out.ndim + len(wanted) for x in wanted):
                out = np.expand_dims(out, axis)
            return out
        if op == "Concat":
            return np.concatenate([np.atleast_1d(x) for x in args], axis=attrs.get("axis", 0))
        if op == "Slice":
            starts, ends = args[1], args[2]
            axes = args[3] if len(args) > 3 and args[3] is not None else range(len(starts))
            steps = args[4] if len(args) > 4 and args[4] is not None else [1] * len(starts)
            index = [slice(None)] * np.ndim(a)
            for s, e, ax, st in zip(starts, ends, axes, steps, strict=False):
                index[int(ax)] = slice(int(s), int(e), int(st))
            return np.asarray(a)[tuple(index)]
        if op == "Neg":
            return -np.asarray(a)
        if op in ("Floor", "Ceil"):
            return np.floor(a) if op == "Floor" else np.ceil(a)
        if op == "Not":
            return np.logical_not(a)
        if op == "ReduceProd":
            return np.prod(a, keepdims=bool(attrs.get("keepdims", 1)))
        b = args[1]
        if op == "Add":
            return np.asarray(a + b)
        if op == "Sub":
            return np.asarray(a - b)
        if op == "Mul":
            return np.asarray(a * b)
        if op == "Div":
            if np.issubdtype(np.asarray(a).dtype, np.integer):
                return np.asarray(np.fix(np.asarray(a) / np.asarray(b))).astype(np.asarray(a).dtype)
            return np.asarray(a / b)
        if op == "Mod":
            return np.fmod(a, b) if attrs.get("fmod", 0) else np.mod(a, b)
        if op == "Max":
            return np.maximum(a, b)
        if op == "Min":
            return np.minimum(a, b)
        if op == "Equal":
            return np.equal(a, b)
        if op == "Less":
            return np.less(a, b)
        if op == "Greater":
            return np.greater(a, b)
        raise NotImplementedError(op)  # pragma: no cover - _SHAPE_OPS lists what is handled


def _attrs(node: onnx.NodeProto) -> tuple[tuple[str, Any], ...]:
    found = []
    for a in node.attribute:
        value = onnx.helper.get_attribute_value(a)
        if isinstance(value, onnx.TensorProto):
            value = onnx.numpy_helper.to_array(value)
        elif isinstance(value, list):
            value = tuple(value)
        found.append((a.name, value))
    return tuple(found)


def _declared_dims(
    vi: onnx.ValueInfoProto, by_param: Mapping[str, Dim]
) -> tuple[int | Dim | None, ...] | None:
    t = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not t.HasField("shape"):
        return None
    dims: list[int | Dim | None] = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        else:
            dims.append(by_param.get(d.dim_param))
    return tuple(dims)


def split_shape_guards(
    model: onnx.ModelProto,
    guards: Sequence[tuple[str, Guard]],
    traced_shapes: Mapping[str, Sequence[int]],
) -> tuple[list[tuple[str, Guard]], list[ShapeGuard]]:
    """Guards (by output name) -> (those that stay graph outputs, those computed from shapes).

    A guard is computed from shapes when every path from it back to a graph input passes a
    ``Shape`` or ``Size`` whose input's dims it reads are known: fixed, or a dynamic dim of a
    graph input (the exporter names them, and ONNX shape inference carries the names through
    the graph), and when so computed on the traced inputs' shapes (``traced_shapes``, by graph
    input name) it gives the traced value. The graph outputs of these are removed from
    ``model``.
    """
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    graph_inputs = {vi.name: vi for vi in graph.input}
    by_param: dict[str, Dim] = {}
    for vi in graph.input:
        t = vi.type.tensor_type
        for axis, d in enumerate(t.shape.dim if t.HasField("shape") else ()):
            if d.dim_param:
                by_param.setdefault(d.dim_param, Dim(vi.name, axis))
    inferred: dict[str, onnx.ValueInfoProto] | None = None
    symbolic: dict[str, onnx.ValueInfoProto] | None = None
    sure: dict[str, Dim] = {}

    def dims_of(name: str) -> tuple[int | Dim | None, ...] | None:
        nonlocal inferred, symbolic
        if name in graph_inputs:
            return _declared_dims(graph_inputs[name], by_param)
        if inferred is None:
            try:
                done = onnx.shape_inference.infer_shapes(model, strict_mode=False)
                inferred = {vi.name: vi for vi in done.graph.value_info}
            except Exception:  # noqa: BLE001 - then only graph inputs' shapes are known
                inferred = {}
        vi = inferred.get(name)
        dims = _declared_dims(vi, by_param) if vi is not None else None
        if dims is not None and None not in dims:
            return dims
        # ONNX's inference loses a dim at the first Range or gathered rows (CLIP's pooled
        # text rows, whose count its loss reads): ONNX Runtime's symbolic inference (seconds
        # on a large graph, so only when asked) names it from the graph inputs' dims. Only
        # the dims it names from an input dim it is sure of are taken: a fixed size there may
        # be a merge of a dynamic one
        if symbolic is None:
            symbolic, unsure = _symbolic_value_infos(model, list(by_param))
            sure.update({k: v for k, v in by_param.items() if k not in unsure})
        vi = symbolic.get(name)
        found = _declared_dims(vi, sure) if vi is not None else None
        if found is None or (dims is not None and len(dims) != len(found)):
            return dims
        return tuple(
            d if d is not None else (f if isinstance(f, Dim) else None)
            for d, f in zip(dims or (None,) * len(found), found, strict=True)
        )

    kept: list[tuple[str, Guard]] = []
    from_shapes: list[ShapeGuard] = []
    for out, guard in guards:
        found = _shape_program(out, producer, dims_of)
        if found is None:
            kept.append((out, guard))
            continue
        nodes, shapes = found
        order = [n for n in graph.node if id(n) in nodes]
        steps = tuple(_Step(n.op_type, tuple(n.input), n.output[0], _attrs(n)) for n in order)
        candidate = ShapeGuard(guard, steps, out, tuple(shapes.items()))
        try:
            holds = candidate.holds(lambda name: traced_shapes[name])
        except (TypeError, ValueError, KeyError, IndexError):
            holds = False  # it reads a dim shape inference left unknown
        if holds:
            from_shapes.append(candidate)
        else:
            kept.append((out, guard))
    removed = {g.output for g in from_shapes}
    if removed:
        outputs = [vi for vi in graph.output if vi.name not in removed]
        del graph.output[:]
        graph.output.extend(outputs)
    return kept, from_shapes


class _Doubts(logging.Handler):
    """Keeps what symbolic inference logs: each record is a dim it assumed (a slice's end
    taken as in range, an unsafe merge) rather than derived."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _symbolic_value_infos(
    model: onnx.ModelProto, dim_names: Sequence[str]
) -> tuple[dict[str, onnx.ValueInfoProto], set[str]]:
    """Each value's shape by ONNX Runtime's symbolic shape inference, with dims named from the
    graph inputs' (partial where it stops; empty where it fails), and the input dim names it
    is unsure of: those in a merge it made (two expressions taken as equal because the graph
    broadcasts them, say ``Min(16, seq) -> seq`` for ``position_ids[:, :seq]``) or in a doubt
    it logged. A guard computed from such a dim could pass on shapes it does not hold for."""
    import_onnxruntime()  # the engine package, without its slow training self-check
    from onnxruntime.tools import symbolic_shape_infer as ssi

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for vi in copy.graph.output:  # the exporter's names for output dims would stick
        vi.type.tensor_type.ClearField("shape")
    log = logging.getLogger(ssi.__name__)
    doubts, propagate = _Doubts(), log.propagate
    log.addHandler(doubts)
    log.propagate = False
    try:
        inference = ssi.SymbolicShapeInference(2**31 - 1, True, True, 0)
        teach_aten_shapes(inference, {})
        inference._preprocess(copy)
        while inference.run_:
            inference._infer_impl()
    except Exception:  # noqa: BLE001 - an operator it cannot follow: the guards stay outputs
        return {}, set(dim_names)
    finally:
        log.removeHandler(doubts)
        log.propagate = propagate
    text = "\n".join(
        [*doubts.messages, *(f"{k} -> {v}" for k, v in inference.suggested_merge_.items())]
    )
    unsure = {
        name for name in dim_names if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w.])", text)
    }
    return dict(inference.known_vi_), unsure


def _shape_program(
    out: str,
    producer: Mapping[str, onnx.NodeProto],
    dims_of: Callable[[str], tuple[int | Dim | None, ...] | None],
) -> tuple[set[int], dict[str, tuple[int | Dim | None, ...]]] | None:
    """The nodes computing ``out`` and the dims of each value a ``Shape``/``Size`` reads, or
    None when ``out`` reads data (or an operation or a dim this module cannot evaluate)."""
    nodes: set[int] = set()
    shapes: dict[str, tuple[int | Dim | None, ...]] = {}
    stack = [out]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is None:
            return None  # a graph input read as data (or an initializer)
        if node.op_type not in _SHAPE_OPS or node.domain not in ("", "ai.onnx"):
            return None
        nodes.add(id(node))
        if node.op_type in ("Shape", "Size"):
            dims = dims_of(node.input[0])
            if dims is None:
                return None
            shapes[node.input[0]] = dims
            continue
        stack.extend(node.input)
    return nodes, shapes


# -- plain data for the export cache --------------------------------------------------------------
#
# The export cache stores nothing but JSON and ONNX bytes (docs/export_cache.md): a shape guard
# goes into an entry's header as the dicts below and comes back through ``shape_guard_from_json``,
# which checks every field's type, allows only the shape operations of ``_SHAPE_OPS`` and the
# dtypes of ``_JSON_DTYPES``, and raises ``ValueError`` on anything else (the entry is then
# removed and the graph exported again). Nothing read is imported, called or unpickled.

_GUARD_KINDS = frozenset({"bool", "int", "float", "item", "tolist", "index"})
_JSON_DTYPES = {
    "bool": (torch.bool, np.bool_),
    "int32": (torch.int32, np.int32),
    "int64": (torch.int64, np.int64),
    "float32": (torch.float32, np.float32),
    "float64": (torch.float64, np.float64),
}
_TORCH_DTYPE_NAMES = {torch_dtype: name for name, (torch_dtype, _) in _JSON_DTYPES.items()}
#: the longest list a header may hold for one value (a guard's steps, an array's elements)
_JSON_LIMIT = 100_000


def _array_to_json(value: np.ndarray) -> dict[str, Any]:
    name = str(value.dtype)
    if name not in _JSON_DTYPES:
        raise TypeError(f"a shape guard holds a {name} array, which the cache does not store")
    return {"array": value.reshape(-1).tolist(), "dtype": name, "shape": list(value.shape)}


def _array_from_json(data: Any) -> np.ndarray:
    if not isinstance(data, dict) or set(data) != {"array", "dtype", "shape"}:
        raise ValueError("bad array in a cached shape guard")
    dtype, shape, values = data["dtype"], data["shape"], data["array"]
    if dtype not in _JSON_DTYPES or not isinstance(values, list) or len(values) > _JSON_LIMIT:
        raise ValueError("bad array in a cached shape guard")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError("bad array shape in a cached shape guard")
    if not all(type(v) in (bool, int, float) for v in values):
        raise ValueError("bad array element in a cached shape guard")
    if int(np.prod(shape)) != len(values):
        raise ValueError("array size and shape disagree in a cached shape guard")
    return np.array(values, dtype=_JSON_DTYPES[dtype][1]).reshape(shape)


def _attr_to_json(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _array_to_json(value)
    if isinstance(value, bool | int | float):
        return {"scalar": value}
    if isinstance(value, bytes):
        return {"text": value.decode("utf-8")}
    if isinstance(value, tuple):
        return {"list": [_attr_to_json(v) for v in value]}
    raise TypeError(f"a shape guard's attribute {value!r} is not stored by the export cache")


def _attr_from_json(data: Any) -> Any:
    if isinstance(data, dict) and len(data) == 1:
        ((kind, value),) = data.items()
        if kind == "scalar" and type(value) in (bool, int, float):
            return value
        if kind == "text" and isinstance(value, str):
            return value.encode("utf-8")
        if kind == "list" and isinstance(value, list) and len(value) <= _JSON_LIMIT:
            return tuple(_attr_from_json(v) for v in value)
    return _array_from_json(data)


def _dim_to_json(dim: int | Dim | None) -> Any:
    return {"input": dim.input, "axis": dim.axis} if isinstance(dim, Dim) else dim


def _dim_from_json(data: Any) -> int | Dim | None:
    if data is None or type(data) is int:
        return data  # type: ignore[no-any-return]
    if (
        isinstance(data, dict)
        and set(data) == {"input", "axis"}
        and isinstance(data["input"], str)
        and type(data["axis"]) is int
    ):
        return Dim(data["input"], data["axis"])
    raise ValueError("bad dim in a cached shape guard")


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("bad names in a cached shape guard")
    return tuple(value)


#: the most elements a guard's traced value may have to be kept in an entry (a ``tolist()`` of
#: a big tensor keeps its export out of the cache)
GUARD_VALUE_LIMIT = 4096


def guard_to_json(guard: Guard) -> dict[str, Any]:
    """A :class:`Guard` as plain JSON data: its kind, traced value and source line (raises
    ``TypeError`` for a value the cache does not hold: another dtype, too many elements)."""
    value = guard.value
    if value.dtype not in _TORCH_DTYPE_NAMES or value.numel() > GUARD_VALUE_LIMIT:
        raise TypeError(f"a guard's value ({value.dtype}, {value.numel()} elements) is not cached")
    return {
        "kind": guard.kind,
        "value": _array_to_json(value.detach().cpu().numpy()),
        "source": guard.source,
    }


def guard_from_json(data: Any) -> Guard:
    """The :class:`Guard` :func:`guard_to_json` wrote; ``ValueError`` for anything else."""
    if not isinstance(data, dict) or set(data) != {"kind", "value", "source"}:
        raise ValueError("bad guard in the cache entry")
    if data["kind"] not in _GUARD_KINDS or not isinstance(data["source"], str):
        raise ValueError("bad guard kind or source in the cache entry")
    array = _array_from_json(data["value"])
    if array.size > GUARD_VALUE_LIMIT:
        raise ValueError("a cached guard's value is too large")
    value = torch.from_numpy(array.copy()).to(_JSON_DTYPES[data["value"]["dtype"]][0])
    return Guard(data["kind"], value, data["source"])


def shape_guard_to_json(guard: ShapeGuard) -> dict[str, Any]:
    """``guard`` as plain JSON data (raises ``TypeError`` for a value it cannot hold)."""
    return {
        **guard_to_json(guard.guard),
        "steps": [
            {
                "op": s.op,
                "inputs": list(s.inputs),
                "output": s.output,
                "attrs": [[name, _attr_to_json(v)] for name, v in s.attrs],
            }
            for s in guard.steps
        ],
        "output": guard.output,
        "shapes": [[name, [_dim_to_json(d) for d in dims]] for name, dims in guard.shapes],
    }


def shape_guard_from_json(data: Any) -> ShapeGuard:
    """The :class:`ShapeGuard` that :func:`shape_guard_to_json` wrote; ``ValueError`` when
    ``data`` is anything else (a field of the wrong type, an operation that is not a shape
    operation, an unknown dtype)."""
    fields = {"kind", "value", "source", "steps", "output", "shapes"}
    if not isinstance(data, dict) or set(data) != fields:
        raise ValueError("bad shape guard in the cache entry")
    guard = guard_from_json({k: data[k] for k in ("kind", "value", "source")})
    steps_data, shapes_data = data["steps"], data["shapes"]
    if not isinstance(steps_data, list) or not isinstance(shapes_data, list):
        raise ValueError("bad steps or shapes in a cached shape guard")
    if len(steps_data) > _JSON_LIMIT or len(shapes_data) > _JSON_LIMIT:
        raise ValueError("too many steps in a cached shape guard")
    steps = []
    for step in steps_data:
        if not isinstance(step, dict) or set(step) != {"op", "inputs", "output", "attrs"}:
            raise ValueError("bad step in a cached shape guard")
        if step["op"] not in _SHAPE_OPS or not isinstance(step["output"], str):
            raise ValueError(f"a cached shape guard names {step['op']!r}, not a shape operation")
        attrs = step["attrs"]
        if not isinstance(attrs, list) or not all(
            isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in attrs
        ):
            raise ValueError("bad attributes in a cached shape guard")
        steps.append(
            _Step(
                step["op"],
                _strings(step["inputs"]),
                step["output"],
                tuple((name, _attr_from_json(v)) for name, v in attrs),
            )
        )
    shapes = []
    for item in shapes_data:
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError("bad shape in a cached shape guard")
        if not isinstance(item[1], list):
            raise ValueError("bad dims in a cached shape guard")
        shapes.append((item[0], tuple(_dim_from_json(d) for d in item[1])))
    if not isinstance(data["output"], str):
        raise ValueError("bad output in a cached shape guard")
    return ShapeGuard(guard, tuple(steps), data["output"], tuple(shapes))
