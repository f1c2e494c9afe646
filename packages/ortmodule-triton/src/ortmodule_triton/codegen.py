"""ONNX subgraph -> the source of one Triton kernel.

Two templates:

* **elementwise** (no reduction in the subgraph): one program per ``BLOCK`` elements of the
  broadcast output shape;
* **row** (the subgraph reduces): the output shape splits into rows (leading axes) and the
  trailing axes every reduction covers; one program per row, the whole row in one block.

Every input is read at the output element's position through its broadcast strides, passed at
run time, so one kernel serves every shape (symbolic dims); a ``constexpr`` flag per input skips
the index arithmetic when the input already has the output's shape. Scalar initializers and
``Constant`` nodes become literals; larger ones are extra kernel inputs.

>>> import onnx
>>> from onnx import TensorProto as T, helper as h
>>> g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g",
...     [h.make_tensor_value_info("x", T.FLOAT, ["n"])], [h.make_tensor_value_info("y", T.FLOAT, ["n"])])
>>> plan = generate(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]))
>>> plan.template, [o.kind for o in plan.outputs]
('elementwise', ['full'])
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx

from ortmodule_exporter.onnx_graph import constant_values

from .emitter import FLOAT_TYPES, Emitter, Val, triton_type
from .errors import TritonCodegenError
from .ops import OPS, REDUCING_OPS, OpContext, reduced_axes

__all__ = ["KernelPlan", "OutputSpec", "TensorSpec", "generate", "model_opset"]

TP = onnx.TensorProto


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: int
    rank: int


@dataclass(frozen=True)
class OutputSpec:
    name: str
    dtype: int
    rank: int
    #: ``full``: the broadcast shape; ``row``: one value per row; ``col``: summed over rows
    kind: str
    #: indices (into inputs + hidden) of the inputs this output depends on
    deps: frozenset[int]


@dataclass(frozen=True)
class KernelPlan:
    """Everything the launcher needs: the source, its signature and how to size outputs."""

    fn_name: str
    source: str
    inputs: tuple[TensorSpec, ...]
    #: non-scalar initializers, passed after the inputs
    hidden: tuple[tuple[str, np.ndarray], ...]
    outputs: tuple[OutputSpec, ...]
    rank: int
    #: first reduced axis (row template) or ``None`` (elementwise template)
    reduce_start: int | None
    #: per dropout: its fixed ``seed`` attribute, or ``None`` for a fresh seed per call
    seeds: tuple[int | None, ...]

    @property
    def template(self) -> str:
        return "elementwise" if self.reduce_start is None else "row"

    @property
    def key(self) -> str:
        return self.fn_name


def model_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return int(o.version)
    return 17


def _rank(vi: onnx.ValueInfoProto, what: str) -> int:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        raise TritonCodegenError(
            f"{what} {vi.name!r} has no shape in the graph; the code generator needs every "
            "input's and output's rank (run onnx.shape_inference first)"
        )
    return len(t.shape.dim)


def _np_onnx_type(arr: np.ndarray) -> int:
    return int(onnx.helper.np_dtype_to_tensor_dtype(arr.dtype))


def _literal(arr: np.ndarray) -> tuple[str, float | int | bool]:
    value = arr.reshape(()).item()
    if isinstance(value, bool):
        return ("True" if value else "False"), value
    if isinstance(value, float):
        if np.isnan(value):
            return "float('nan')", value
        if np.isinf(value):
            return ("float('inf')" if value > 0 else "float('-inf')"), value
        return repr(float(value)), value
    return repr(int(value)), int(value)


#: inputs that are attributes in disguise (read as constants, not loaded)
META_INPUTS = {"ReduceSum": 1, "ReduceMean": 1, "ReduceMax": 1}


def generate(model: onnx.ModelProto, name: str | None = None) -> KernelPlan:
    """The kernel for ``model``'s graph (its inputs and outputs, in order)."""
    graph = model.graph
    opset = model_opset(model)
    consts = constant_values(model.graph)
    init_names = {i.name for i in graph.initializer}
    inputs = tuple(
        TensorSpec(vi.name, vi.type.tensor_type.elem_type, _rank(vi, "input"))
        for vi in graph.input
        if vi.name not in init_names
    )
    if not inputs:
        raise TritonCodegenError("the subgraph has no tensor input; nothing sets its shape")
    compute = [
        n for n in graph.node if not (n.op_type == "Constant" and n.domain in ("", "ai.onnx"))
    ]
    for node in compute:
        if (node.domain if node.domain != "ai.onnx" else "", node.op_type) not in OPS:
            raise TritonCodegenError(
                f"node {node.name or '<unnamed>'}: op {node.domain or 'ai.onnx'}::{node.op_type} "
                "is not supported by the Triton code generator (see ortmodule_triton.supported_ops())"
            )
    # which constants are read as data (vs. axes) and are too large for a literal
    data_consts = {
        name
        for n in compute
        for j, name in enumerate(n.input)
        if name in consts and not (j == META_INPUTS.get(n.op_type, -1))
    }
    hidden = tuple((c, consts[c]) for c in sorted(data_consts) if consts[c].size != 1)
    loaded = [*inputs, *(TensorSpec(c, _np_onnx_type(a), a.ndim) for c, a in hidden)]
    rank = max(t.rank for t in loaded)
    reduces = any(
        (n.domain if n.domain != "ai.onnx" else "", n.op_type) in REDUCING_OPS for n in compute
    )
    em = Emitter(reduced=reduces)

    values: dict[str, Val] = {}
    deps: dict[str, frozenset[int]] = {}
    for index, spec in enumerate(loaded):
        triton_type(spec.dtype, f"input {spec.name!r}")  # refuses unsupported types early
        em.line(f"if BC{index}:")
        offset = (
            " + ".join(f"((flat // rs{d}) % rd{d}) * in{index}_s{d}" for d in range(rank)) or "0"
        )
        em.line(f"    off{index} = {offset}")
        em.line("else:")
        em.line(f"    off{index} = flat")
        load = f"tl.load(in{index} + off{index}, mask=mask, other={'0.0' if spec.dtype in FLOAT_TYPES else '0'})"
        if spec.dtype in FLOAT_TYPES:
            load += ".to(tl.float32)"
        em.line(f"x{index} = {load}")
        values[spec.name] = Val(f"x{index}", spec.dtype, "full", spec.rank)
        deps[spec.name] = frozenset({index})
    for cname, arr in consts.items():
        if arr.size == 1 and cname in data_consts:
            text, literal = _literal(arr)
            values[cname] = Val(text, _np_onnx_type(arr), "const", arr.ndim, literal)
            deps[cname] = frozenset()

    reduce_start: int | None = None
    for node in compute:
        domain = node.domain if node.domain != "ai.onnx" else ""
        where = f"node {node.name or '<unnamed>'} ({node.op_type})"
        skip = META_INPUTS.get(node.op_type, -1)
        ins: list[Val | None] = []
        for j, iname in enumerate(node.input):
            if j == skip or not iname:
                ins.append(None)
                continue
            if iname not in values:
                raise TritonCodegenError(
                    f"{where}: input {iname!r} is neither a graph input, an initializer nor "
                    "produced earlier (nodes must be in topological order)"
                )
            ins.append(values[iname])
        axes: tuple[int, ...] = ()
        if (domain, node.op_type) in REDUCING_OPS:
            x = (
                ins[0]
                if domain == ""
                else ins[1 if node.op_type == "LayerNormalizationGrad" else 0]
            )
            assert x is not None
            if x.rank != rank:
                raise TritonCodegenError(
                    f"{where}: reduces a rank-{x.rank} value in a rank-{rank} subgraph; every "
                    "reduction of one kernel must read full-rank values"
                )
            given = None
            if skip >= 0 and len(node.input) > skip and node.input[skip]:
                if node.input[skip] not in consts:
                    raise TritonCodegenError(f"{where}: axes must be a constant")
                given = [int(a) for a in consts[node.input[skip]].reshape(-1)]
            found = reduced_axes(node, rank, opset, given)
            start = found[0]
            if found != list(range(start, rank)):
                raise TritonCodegenError(
                    f"{where}: reduces axes {found} of a rank-{rank} tensor; the generated "
                    "kernel reduces trailing axes only (e.g. [-1])"
                )
            if reduce_start is not None and start != reduce_start:
                raise TritonCodegenError(
                    f"{where}: reduces from axis {start} while an earlier reduction of the "
                    f"subgraph reduces from axis {reduce_start}; split the subgraph"
                )
            reduce_start = start
            axes = tuple(found)
        outs = OPS[(domain, node.op_type)](em, OpContext(node, opset, axes), ins)
        dep = frozenset().union(*(deps.get(i, frozenset()) for i in node.input if i))
        for oname, val in zip(node.output, outs, strict=False):
            if oname and val is not None:
                values[oname] = val
                deps[oname] = dep

    outputs: list[OutputSpec] = []
    for k, vi in enumerate(graph.output):
        if vi.name not in values:
            raise TritonCodegenError(f"graph output {vi.name!r} is not computed by the subgraph")
        val = values[vi.name]
        dtype = vi.type.tensor_type.elem_type or val.dtype
        out_rank = _rank(vi, "output") if vi.type.tensor_type.HasField("shape") else val.rank
        if val.kind == "const":
            raise TritonCodegenError(f"graph output {vi.name!r} is a constant; fold it instead")
        if val.kind == "full" and out_rank != rank:
            raise TritonCodegenError(
                f"graph output {vi.name!r} has rank {out_rank}, the kernel's shape rank {rank}"
            )
        if val.kind == "row" and out_rank not in (rank, reduce_start):
            raise TritonCodegenError(
                f"graph output {vi.name!r}: a reduction output of rank {out_rank} fits neither "
                "keepdims=1 nor keepdims=0"
            )
        tt = triton_type(dtype, f"output {vi.name!r}")
        if val.kind == "full":
            em.line(f"tl.store(out{k} + flat, ({val.expr}).to({tt}), mask=mask)")
        elif val.kind == "row":
            em.line(f"tl.store(out{k} + row, ({val.expr}).to({tt}), mask=row_mask)")
        else:
            part = f"tl.sum(tl.where(mask, ({val.expr}).to(tl.float32), 0.0), axis=0)"
            em.line(
                f"tl.atomic_add(out{k} + tl.arange(0, BLOCK), {part}, mask=tl.arange(0, BLOCK) < N)"
            )
        outputs.append(OutputSpec(vi.name, dtype, out_rank, val.kind, deps[vi.name]))

    for val in values.values():
        if val.kind == "col" and val.expr not in {values[o.name].expr for o in outputs}:
            raise TritonCodegenError(
                "a LayerNormalizationGrad scale/bias gradient must be a graph output"
            )

    n_in, n_out = len(loaded), len(outputs)
    params = [f"in{i}" for i in range(n_in)] + [f"out{k}" for k in range(n_out)]
    params += ["M", "N"] if reduces else ["NUMEL"]
    params += [f"rd{d}" for d in range(rank)] + [f"rs{d}" for d in range(rank)]
    params += [f"in{i}_s{d}" for i in range(n_in) for d in range(rank)]
    params += [s for s, _ in em.seeds]
    params += [f"BC{i}: tl.constexpr" for i in range(n_in)]
    params.append("BLOCK: tl.constexpr")
    if reduces:
        params.append("ROWS: tl.constexpr")
    if reduces:
        # ROWS rows per program, [ROWS, BLOCK] tiles: short rows still fill a program
        head = [
            "row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]",
            "cols = tl.arange(0, BLOCK)[None, :]",
            "row_mask = row < M",
            "mask = row_mask & (cols < N)",
            "flat = row * N + cols",
        ]
    else:
        head = [
            "flat = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)",
            "mask = flat < NUMEL",
        ]
    body = "\n".join("    " + line for line in [*head, *em.lines])
    digest = hashlib.sha1((body + ",".join(params)).encode(), usedforsecurity=False).hexdigest()[
        :12
    ]
    fn_name = name or f"triton_subgraph_{digest}"
    signature = ",\n    ".join(params)
    source = (
        "import triton\nimport triton.language as tl\n\n\n"
        f"def {fn_name}(\n    {signature},\n):\n{body}\n"
    )
    return KernelPlan(
        fn_name=fn_name,
        source=source,
        inputs=inputs,
        hidden=hidden,
        outputs=tuple(outputs),
        rank=rank,
        reduce_start=reduce_start,
        seeds=tuple(seed for _, seed in em.seeds),
    )
