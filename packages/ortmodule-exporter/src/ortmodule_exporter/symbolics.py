"""The symbolics ORTModule needs so the engine can differentiate common operators.

Each one exists because PyTorch's default export is either not differentiable by the engine
(it drops outputs the gradient needs, or emits an operator the engine has no gradient or no
CPU gradient kernel for) or computes something other than eager PyTorch. Operators whose
default export already trains correctly (gelu below opset 20, unsqueeze, argmax, numpy_T,
float32 convolution, dropout) keep PyTorch's symbolic; ``tests/test_symbolics.py`` guards them.

Every symbolic here emits only ONNX / com.microsoft operators the engine differentiates, and
keeps all input dims dynamic: sizes are read with ``Shape`` at run time, never baked in from
the traced example.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from typing import Any

import torch
from torch.onnx import symbolic_helper as sh

from . import aten_executor
from .symbolic_registry import register_symbolic

Value = Any  # torch._C.Value; the exporter's graph values are untyped in Python

_INT64_MAX = 2**63 - 1

# TorchScript scalar type names -> ONNX TensorProto element types
_ONNX_TYPE = {
    "Float": 1,
    "Byte": 2,
    "Char": 3,
    "Short": 5,
    "Int": 6,
    "Long": 7,
    "Bool": 9,
    "Half": 10,
    "Double": 11,
    "BFloat16": 16,
}
_TORCH_TYPE = {
    "Float": torch.float32,
    "Half": torch.float16,
    "Double": torch.float64,
    "BFloat16": torch.bfloat16,
    "Long": torch.int64,
    "Int": torch.int32,
    "Bool": torch.bool,
}
# c10::ScalarType codes, as aten ops receive a ``dtype`` argument
_SCALAR_TYPE_CODE = {5: "Half", 6: "Float", 7: "Double", 15: "BFloat16"}
_FLOAT_TYPES = ("Float", "Half", "Double", "BFloat16")


# -- small graph helpers -----------------------------------------------------------------------


def _scalar_type(v: Value) -> str | None:
    try:
        return v.type().scalarType()  # type: ignore[no-any-return]
    except RuntimeError:
        return None


def _float_type(v: Value) -> str:
    name = _scalar_type(v)
    return name if name in _FLOAT_TYPES else "Float"


def _rank(v: Value, op: str) -> int:
    rank = sh._get_tensor_rank(v)
    if rank is None:
        raise ValueError(f"{op}: the rank of the input is not known at export time")
    return int(rank)


def _const(g: Any, value: Any, dtype: torch.dtype = torch.float32) -> Value:
    return g.op("Constant", value_t=torch.tensor(value, dtype=dtype))


def _ints(g: Any, values: Sequence[int]) -> Value:
    return _const(g, list(values), torch.int64)


def _shape(g: Any, x: Value) -> Value:
    return g.op("Shape", x)


def _dims(g: Any, x: Value, start: int, end: int | None = None) -> Value:
    """Shape(x)[start:end] as a 1-D int64 tensor."""
    stop = _INT64_MAX if end is None else end
    return g.op("Slice", _shape(g, x), _ints(g, [start]), _ints(g, [stop]))


def _dim(g: Any, x: Value, axis: int) -> Value:
    """Shape(x)[axis] as a 1-element 1-D int64 tensor."""
    return g.op("Gather", _shape(g, x), _ints(g, [axis]))


def _dim_scalar(g: Any, x: Value, axis: int) -> Value:
    """Shape(x)[axis] as a 0-d int64 tensor."""
    return g.op("Squeeze", _dim(g, x, axis), _ints(g, [0]))


def _concat(g: Any, *parts: Value) -> Value:
    return parts[0] if len(parts) == 1 else g.op("Concat", *parts, axis_i=0)


def _unsqueeze(g: Any, x: Value, axes: Sequence[int]) -> Value:
    return g.op("Unsqueeze", x, _ints(g, axes))


def _squeeze(g: Any, x: Value, axes: Sequence[int]) -> Value:
    return g.op("Squeeze", x, _ints(g, axes))


def _reduce(g: Any, op: str, x: Value, axes: Sequence[int] | None, keepdims: bool) -> Value:
    """Reduce over ``axes`` (all when None); ReduceSum takes axes as an input from opset 13,
    the others from opset 18."""
    if axes is None:
        return g.op(op, x, keepdims_i=int(keepdims))
    if op == "ReduceSum" or g.opset >= 18:
        return g.op(op, x, _ints(g, axes), keepdims_i=int(keepdims))
    return g.op(op, x, axes_i=list(axes), keepdims_i=int(keepdims))


def _cast(g: Any, x: Value, type_name: str) -> Value:
    return g.op("Cast", x, to_i=_ONNX_TYPE[type_name])


def _stop_gradient(g: Any, v: Value) -> Value:
    """``v``'s exact value with no gradient path back to ``v``.

    ONNX has no stop-gradient operator. The engine never differentiates BatchNormalization
    through its running-mean input (a stop-gradient edge), and a training-mode node with
    momentum 1 hands that input back unchanged as its new running mean (``mean * 1 + batch_mean
    * 0`` with a zero batch), so the value crosses without a gradient edge. Cost: one pass over
    ``v``.
    """
    dtype = _TORCH_TYPE[_float_type(v)]
    flat = g.op("Reshape", v, _ints(g, [-1]))
    n = _shape(g, flat)

    def filled(shape: Value, value: float) -> Value:
        return g.op("ConstantOfShape", shape, value_t=torch.tensor([value], dtype=dtype))

    # two zero rows: a one-row batch has no variance, which some kernels reject
    zeros_x = filled(_concat(g, _ints(g, [2]), n), 0.0)
    ones, zeros = filled(n, 1.0), filled(n, 0.0)
    _, running_mean, _ = g.op(
        "BatchNormalization",
        zeros_x,
        ones,
        zeros,
        flat,
        ones,
        epsilon_f=1e-5,
        momentum_f=1.0,
        training_mode_i=1,
        outputs=3,
    )
    return g.op("Reshape", running_mean, _shape(g, v))


def _const_ints(v: Value) -> list[int] | None:
    """A constant int or int list argument as a list, None when absent or not constant."""
    if v is None or sh._is_none(v):
        return None
    if not sh._is_constant(v):
        return None
    value = sh._node_get(v.node(), "value")
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    return [int(i) for i in value] if isinstance(value, (list, tuple)) else [int(value)]


def _per_dim(values: Sequence[int], n: int, default: Sequence[int] | None = None) -> list[int]:
    """A per-spatial-dim list from aten's form: one value for every dim, or empty = default."""
    values = list(values) if values else list(default or [])
    return values * n if len(values) == 1 else values


def _device_type(v: Value) -> str | None:
    """The traced tensor's device type ("cpu", "cuda"), None when the exporter does not say."""
    try:
        device = v.type().device()
    except (RuntimeError, AttributeError):
        return None
    return None if device is None else str(device.type)


# -- normalization ---------------------------------------------------------------------------


@sh.parse_args("v", "is", "v", "v", "f", "b")
def layer_norm(
    g: Any, x: Value, shape: list[int], weight: Value, bias: Value, eps: float, _cudnn: bool
) -> Value:
    # The engine's LayerNormalizationGrad consumes the saved mean and inverse std-dev, so the
    # forward node must produce all three outputs (the default export keeps only the first).
    dtype = _TORCH_TYPE[_float_type(x)]
    if sh._is_none(weight):
        weight = g.op("Constant", value_t=torch.ones(shape, dtype=dtype))
    if sh._is_none(bias):
        bias = g.op("Constant", value_t=torch.zeros(shape, dtype=dtype))
    y, _mean, _inv_std = g.op(
        "LayerNormalization", x, weight, bias, epsilon_f=eps, axis_i=-len(shape), outputs=3
    )
    return y


@sh.parse_args("v", "i", "v", "v", "f", "b")
def group_norm(
    g: Any, x: Value, groups: int, weight: Value, bias: Value, eps: float, _cudnn: bool
) -> Value:
    # The default export uses InstanceNormalization, which the engine cannot differentiate.
    # Normalizing (N, G, C/G * spatial) over its last axis is the same computation, done by the
    # LayerNormalization kernel the engine has a gradient for.
    rank = _rank(x, "aten::group_norm")
    dtype = _TORCH_TYPE[_float_type(x)]
    grouped = g.op("Reshape", x, _ints(g, [0, groups, -1]))
    norm_size = _dims(g, grouped, 2)
    ones = g.op("ConstantOfShape", norm_size, value_t=torch.tensor([1.0], dtype=dtype))
    zeros = g.op("ConstantOfShape", norm_size, value_t=torch.tensor([0.0], dtype=dtype))
    y, _mean, _inv_std = g.op(
        "LayerNormalization", grouped, ones, zeros, epsilon_f=eps, axis_i=-1, outputs=3
    )
    y = g.op("Reshape", y, _shape(g, x))
    per_channel = list(range(1, rank - 1))
    if not sh._is_none(weight):
        y = g.op("Mul", y, _unsqueeze(g, weight, per_channel))
    if not sh._is_none(bias):
        y = g.op("Add", y, _unsqueeze(g, bias, per_channel))
    return y


# -- losses ----------------------------------------------------------------------------------

_REDUCTIONS = ("none", "mean", "sum")


def _batched_class_input(g: Any, x: Value, target: Value, op: str) -> tuple[Value, Value, bool]:
    """(C,) scores with a 0-d target are one sample: give both a batch axis."""
    if _rank(x, op) == 1:
        return _unsqueeze(g, x, [0]), _unsqueeze(g, target, [0]), True
    return x, target, False


def _weighted_count(g: Any, target: Value, ignored: Value, weight: Value, like: str) -> Value:
    """The mean-reduction denominator: sum of the class weights of the non-ignored targets."""
    zero = _const(g, 0.0, _TORCH_TYPE[like])
    if sh._is_none(weight):
        return g.op("ReduceSum", _cast(g, g.op("Not", ignored), like), keepdims_i=0)
    safe = g.op("Where", ignored, _const(g, 0, torch.int64), target)
    return g.op(
        "ReduceSum", g.op("Where", ignored, zero, g.op("Gather", weight, safe)), keepdims_i=0
    )


@sh.parse_args("v", "v", "v", "i", "i", "f")
def cross_entropy_loss(
    g: Any,
    logits: Value,
    target: Value,
    weight: Value,
    reduction: int,
    ignore_index: int,
    label_smoothing: float,
) -> Value:
    # The default export emits SoftmaxCrossEntropyLoss without its log-prob output, which the
    # engine's gradient needs, and rejects label smoothing. With both outputs the engine
    # differentiates ignore_index, class weights and every reduction; label smoothing is added
    # as ATen does: (1 - e) * loss + e / C * (the class-weighted -sum of log-probs, reduced
    # like the loss). (com.microsoft::SoftmaxCrossEntropyLossInternal crashes the engine when
    # exported this way, so the standard operator is used.)
    op = "aten::cross_entropy_loss"
    like = _float_type(logits)
    scores, labels, unbatched = _batched_class_input(g, logits, target, op)
    mode = _REDUCTIONS[reduction]
    args = [scores, labels] if sh._is_none(weight) else [scores, labels, weight]
    loss, _log_prob = g.op(
        "SoftmaxCrossEntropyLoss", *args, reduction_s=mode, ignore_index_i=ignore_index, outputs=2
    )
    if unbatched and mode == "none":
        loss = _squeeze(g, loss, [0])
    if label_smoothing <= 0.0:
        return loss

    rank = _rank(scores, op)
    log_prob = g.op("LogSoftmax", scores, axis_i=1)
    if not sh._is_none(weight):
        log_prob = g.op("Mul", log_prob, _unsqueeze(g, weight, list(range(1, rank - 1))))
    smooth = g.op("Neg", _reduce(g, "ReduceSum", log_prob, [1], keepdims=False))
    ignored = g.op("Equal", labels, _const(g, ignore_index, torch.int64))
    smooth = g.op("Where", ignored, _const(g, 0.0, _TORCH_TYPE[like]), smooth)
    if mode == "none":
        if unbatched:
            smooth = _squeeze(g, smooth, [0])
    elif mode == "sum":
        smooth = g.op("ReduceSum", smooth, keepdims_i=0)
    else:
        total = g.op("ReduceSum", smooth, keepdims_i=0)
        smooth = g.op("Div", total, _weighted_count(g, labels, ignored, weight, like))
    classes = _cast(g, _dim(g, scores, 1), like)
    smooth_scale = g.op("Div", _const(g, [label_smoothing], _TORCH_TYPE[like]), classes)
    smooth = g.op("Mul", smooth, _squeeze(g, smooth_scale, [0]))
    kept = g.op("Mul", loss, _const(g, 1.0 - label_smoothing, _TORCH_TYPE[like]))
    return g.op("Add", kept, smooth)


@sh.parse_args("v", "v", "v", "i", "i")
def nll_loss(
    g: Any, log_prob: Value, target: Value, weight: Value, reduction: int, ignore_index: int
) -> Value:
    # The default NegativeLogLikelihoodLoss has no gradient in the engine. Picking the target
    # entries with GatherElements (differentiable) and weighting them is the same loss.
    op = "aten::nll_loss"
    like = _float_type(log_prob)
    scores, labels, unbatched = _batched_class_input(g, log_prob, target, op)
    mode = _REDUCTIONS[reduction]
    ignored = g.op("Equal", labels, _const(g, ignore_index, torch.int64))
    safe = g.op("Where", ignored, _const(g, 0, torch.int64), labels)
    picked = _squeeze(g, g.op("GatherElements", scores, _unsqueeze(g, safe, [1]), axis_i=1), [1])
    loss = g.op("Neg", picked)
    if not sh._is_none(weight):
        loss = g.op("Mul", loss, g.op("Gather", weight, safe))
    loss = g.op("Where", ignored, _const(g, 0.0, _TORCH_TYPE[like]), loss)
    if mode == "none":
        return _squeeze(g, loss, [0]) if unbatched else loss
    total = g.op("ReduceSum", loss, keepdims_i=0)
    if mode == "sum":
        return total
    return g.op("Div", total, _weighted_count(g, labels, ignored, weight, like))


# -- embedding -------------------------------------------------------------------------------


@sh.parse_args("v", "v", "i", "b", "b")
def embedding(
    g: Any, weight: Value, indices: Value, padding_idx: int, scale_grad_by_freq: bool, _sparse: bool
) -> Value:
    # The default export is a plain Gather: row padding_idx receives gradient and
    # scale_grad_by_freq is rejected. Eager gives the padding row no gradient and divides each
    # row's gradient by how often its index occurs in the batch; the forward value is always
    # the plain lookup.
    rows = g.op("Gather", weight, indices)
    has_padding = padding_idx >= 0
    if not has_padding and not scale_grad_by_freq:
        return rows
    like = _float_type(weight)
    if has_padding:
        is_pad = g.op("Equal", indices, _const(g, padding_idx, torch.int64))
    if not scale_grad_by_freq:
        pad_row = _stop_gradient(g, g.op("Gather", weight, _const(g, padding_idx, torch.int64)))
        return g.op("Where", _unsqueeze(g, is_pad, [-1]), pad_row, rows)

    if g.opset < 16:
        raise ValueError(
            "aten::embedding: scale_grad_by_freq=True needs opset 16 or newer "
            "(ScatterElements with reduction='add'); export with opset >= 16"
        )
    flat = g.op("Reshape", indices, _ints(g, [-1]))
    vocab = _dim(g, weight, 0)
    zeros = g.op("ConstantOfShape", vocab, value_t=torch.tensor([0.0], dtype=_TORCH_TYPE[like]))
    ones = g.op(
        "ConstantOfShape", _shape(g, flat), value_t=torch.tensor([1.0], dtype=_TORCH_TYPE[like])
    )
    counts = g.op("ScatterElements", zeros, flat, ones, axis_i=0, reduction_s="add")
    scale = g.op("Reciprocal", g.op("Gather", counts, indices))
    if has_padding:
        scale = g.op("Where", is_pad, _const(g, 0.0, _TORCH_TYPE[like]), scale)
    # value: rows exactly; gradient: scale * incoming gradient
    frozen = _stop_gradient(g, rows)
    delta = g.op("Mul", g.op("Sub", rows, frozen), _unsqueeze(g, scale, [-1]))
    return g.op("Add", frozen, delta)


# -- softmax ---------------------------------------------------------------------------------


def _softmax_like(onnx_op: str) -> Any:
    @sh.parse_args("v", "i", "none")
    def symbolic(g: Any, x: Value, dim: int, dtype: Value = None) -> Value:
        # ATen casts to ``dtype`` before the softmax; the default export casts the result, so
        # a float16 input with dtype=float32 loses the precision the caller asked for. The
        # exception is float64 off CUDA: the CPU engine has no float64 SoftmaxGrad or
        # LogSoftmaxGrad kernel, so the softmax stays in the input's type and only the result
        # is cast (trainable, at the input's precision).
        code = _const_ints(dtype)
        if code is None:
            return g.op(onnx_op, x, axis_i=dim)
        name = _SCALAR_TYPE_CODE.get(code[0])
        if name is None:
            raise ValueError(f"aten::{onnx_op.lower()}: unsupported dtype code {code[0]}")
        if name == "Double" and _device_type(x) != "cuda" and _scalar_type(x) != "Double":
            return _cast(g, g.op(onnx_op, x, axis_i=dim), name)
        if _scalar_type(x) != name:
            x = _cast(g, x, name)
        return g.op(onnx_op, x, axis_i=dim)

    return symbolic


softmax = _softmax_like("Softmax")
log_softmax = _softmax_like("LogSoftmax")


# -- gelu ------------------------------------------------------------------------------------


@sh.parse_args("v", "s")
def gelu(g: Any, x: Value, approximate: str = "none") -> Value:
    # From opset 20 the default export is ONNX Gelu, and the engine differentiates every Gelu
    # node with the exact (erf) formula, also approximate="tanh" ones. FastGelu is the tanh
    # formula with its own gradient. (Below opset 20 the default decomposition is correct.)
    if approximate == "tanh":
        return g.op("com.microsoft::FastGelu", x)
    return g.op("Gelu", x)


# -- max / min -------------------------------------------------------------------------------


def _tie_split_extreme(
    g: Any, x: Value, axes: list[int] | None, keepdim: bool, largest: bool
) -> Value:
    """max/min over ``axes`` whose gradient is shared evenly by the tied elements (eager's
    rule for ``max()`` and ``amax``). The extreme value only selects: it reaches the result
    through Equal, which the engine never differentiates."""
    extreme = _reduce(g, "ReduceMax" if largest else "ReduceMin", x, axes, keepdims=True)
    hit = g.op("Equal", x, extreme)
    like = _float_type(x)
    picked = g.op("Where", hit, x, _const(g, 0.0, _TORCH_TYPE[like]))
    count = _reduce(g, "ReduceSum", _cast(g, hit, like), axes, keepdims=keepdim)
    total = _reduce(g, "ReduceSum", picked, axes, keepdims=keepdim)
    return g.op("Div", total, count)


def _reduce_axes(g: Any, op: str, x: Value, dims: list[int] | None) -> list[int] | None:
    if not dims:
        return None
    rank = _rank(x, op)
    return [d % rank if rank else 0 for d in dims]


def _max_min(largest: bool) -> Any:
    name = "aten::max" if largest else "aten::min"

    def symbolic(g: Any, x: Value, dim_or_other: Value = None, keepdim: Value = None) -> Any:
        if dim_or_other is None and keepdim is None:
            return _tie_split_extreme(g, x, None, False, largest)
        if keepdim is None:  # binary max(x, other): the default Max/Min has a gradient
            other = dim_or_other
            if _scalar_type(other) != _scalar_type(x) and _scalar_type(x) in _FLOAT_TYPES:
                other = _cast(g, other, _float_type(x))
            return g.op("Max" if largest else "Min", x, other)
        # max(x, dim, keepdim) -> (values, indices): TopK has a gradient and, like eager,
        # returns the first of tied elements.
        dim = sh._get_const(dim_or_other, "i", "dim")
        keep = bool(sh._get_const(keepdim, "i", "keepdim"))
        if _rank(x, name) == 0:
            return x, _const(g, 0, torch.int64)
        if _scalar_type(x) in ("Half", "BFloat16") and _on_cpu(x) and aten_executor.installed():
            # the CPU engine's TopK has no bfloat16 kernel and runs float16 through float32
            # casts (the values came back float32): PyTorch's own max/min runs instead
            return _aten_max_min(g, x, dim_or_other, keepdim, largest, _rank(x, name) - (not keep))
        values, indices = g.op(
            "TopK", x, _ints(g, [1]), axis_i=dim, largest_i=int(largest), sorted_i=1, outputs=2
        )
        if not keep:
            values, indices = _squeeze(g, values, [dim]), _squeeze(g, indices, [dim])
        return values, indices

    return symbolic


def _on_cpu(v: Value) -> bool:
    jit_type: Any = v.type()
    device = jit_type.device() if hasattr(jit_type, "device") else None
    return device is None or device.type == "cpu"


def _aten_max_min(
    g: Any, x: Value, dim: Value, keepdim: Value, largest: bool, out_rank: int
) -> tuple[Value, Value]:
    values, indices = g.op(
        f"{aten_executor.ATEN_DOMAIN}::ATen",
        x,
        dim,
        keepdim,
        operator_s="max" if largest else "min",
        overload_name_s="dim",
        outputs=2,
    )
    values.setType(x.type().with_sizes([None] * out_rank))
    indices.setType(x.type().with_dtype(torch.int64).with_sizes([None] * out_rank))
    return values, indices


def _amax_amin(largest: bool) -> Any:
    name = "aten::amax" if largest else "aten::amin"

    @sh.parse_args("v", "is", "i")
    def symbolic(g: Any, x: Value, dim: list[int], keepdim: int) -> Value:
        return _tie_split_extreme(g, x, _reduce_axes(g, name, x, dim), bool(keepdim), largest)

    return symbolic


# -- shapes ----------------------------------------------------------------------------------


def squeeze(g: Any, x: Value, dim: Value = None) -> Value:
    # With dynamic dims the default export wraps squeeze(dim) in an If the engine cannot
    # build a gradient through (and squeeze(dims) does not export at all). Eager drops each
    # listed dim only when its size is 1, which a Reshape to the filtered shape does at run
    # time.
    if dim is None:
        return g.op("Squeeze", x)
    dims = _const_ints(dim)
    if dims is None:
        raise ValueError("aten::squeeze: the dims to squeeze must be constants")
    rank = _rank(x, "aten::squeeze")
    if rank == 0:
        return g.op("Identity", x)
    targets = {d % rank for d in dims}
    shape = _shape(g, x)
    keep = []
    for axis in range(rank):
        if axis in targets:
            size = g.op("Gather", shape, _ints(g, [axis]))
            keep.append(g.op("Not", g.op("Equal", size, _ints(g, [1]))))
        else:
            keep.append(_const(g, [True], torch.bool))
    new_shape = g.op("Compress", shape, _concat(g, *keep), axis_i=0)
    return g.op("Reshape", x, new_shape, allowzero_i=1)


# -- einsum ----------------------------------------------------------------------------------


def _prod(g: Any, dims: Value, count: int) -> Value:
    """Product of a 1-D int64 shape slice as a 1-element tensor ([1] when empty)."""
    if count == 0:
        return _ints(g, [1])
    if count == 1:
        return dims
    return g.op("ReduceProd", dims, keepdims_i=1)


class _Einsum:
    """A decomposition of einsum into Transpose, Reshape, MatMul, Mul and ReduceSum (the
    default export's Einsum node has no gradient in the engine). Operands are folded left to
    right; each pairwise contraction is one batched MatMul."""

    def __init__(self, g: Any, equation: str, operands: list[Value]) -> None:
        self.g = g
        self.equation = equation.replace(" ", "")
        self.operands = operands

    def _labels(self) -> tuple[list[list[str]], list[str]]:
        eq = self.equation
        lhs, arrow, rhs = eq.partition("->")
        terms = lhs.split(",")
        if len(terms) != len(self.operands):
            raise ValueError(
                f"aten::einsum: {eq!r} names {len(terms)} operands, got {len(self.operands)}"
            )
        spare = [c for c in string.ascii_letters if c not in eq]
        ranks = [_rank(v, "aten::einsum") for v in self.operands]
        ellipsis_rank = max(
            [
                r - len(t.replace("...", ""))
                for t, r in zip(terms, ranks, strict=True)
                if "..." in t
            ],
            default=0,
        )
        ell = spare[:ellipsis_rank]
        labels = []
        for term, rank in zip(terms, ranks, strict=True):
            if "..." in term:
                head, tail = term.split("...")
                n = rank - len(head) - len(tail)
                labels.append([*head, *ell[ellipsis_rank - n :], *tail])
            else:
                if len(term) != rank:
                    raise ValueError(
                        f"aten::einsum: {term!r} does not match an operand of rank {rank}"
                    )
                labels.append(list(term))
        if arrow:
            head, dots, tail = rhs.partition("...")
            out = [*head, *(ell if dots else []), *tail]
        else:
            counts: dict[str, int] = {}
            for ls in labels:
                for c in ls:
                    counts[c] = counts.get(c, 0) + 1
            out = [*ell, *sorted(c for c, n in counts.items() if n == 1 and c not in ell)]
        return labels, out

    def run(self) -> Value:
        labels, out = self._labels()
        items = [self._diagonal(v, ls) for v, ls in zip(self.operands, labels, strict=True)]
        value, current = items[0]
        for i in range(1, len(items)):
            later = {c for _, ls in items[i + 1 :] for c in ls} | set(out)
            other, other_labels = items[i]
            value, current = self._sum_unused(value, current, set(other_labels) | later)
            other, other_labels = self._sum_unused(other, other_labels, set(current) | later)
            value, current = self._pair(value, current, other, other_labels, later)
        value, current = self._sum_unused(value, current, set(out))
        missing = [c for c in out if c not in current]
        if missing:
            raise ValueError(
                f"aten::einsum: output labels {missing} appear in no operand of {self.equation!r}"
            )
        return self._transpose(value, current, out)

    def _transpose(self, x: Value, labels: list[str], order: list[str]) -> Value:
        perm = [labels.index(c) for c in order]
        return x if perm == list(range(len(perm))) else self.g.op("Transpose", x, perm_i=perm)

    def _sum_unused(self, x: Value, labels: list[str], needed: set[str]) -> tuple[Value, list[str]]:
        axes = [i for i, c in enumerate(labels) if c not in needed]
        if not axes:
            return x, labels
        x = _reduce(self.g, "ReduceSum", x, axes, keepdims=False)
        return x, [c for c in labels if c in needed]

    def _diagonal(self, x: Value, labels: list[str]) -> tuple[Value, list[str]]:
        """Collapse repeated labels of one operand to their diagonal (a masked sum)."""
        g = self.g
        labels = list(labels)
        while len(set(labels)) != len(labels):
            first = next(c for c in labels if labels.count(c) > 1)
            i = labels.index(first)
            j = labels.index(first, i + 1)
            n = _dim_scalar(g, x, i)
            idx = g.op("Range", _const(g, 0, torch.int64), n, _const(g, 1, torch.int64))
            eye = _cast(
                g, g.op("Equal", _unsqueeze(g, idx, [1]), _unsqueeze(g, idx, [0])), _float_type(x)
            )
            rank = len(labels)
            shape_axes = [a for a in range(rank) if a not in (i, j)]
            mask = _unsqueeze(g, eye, shape_axes) if shape_axes else eye
            x = _reduce(g, "ReduceSum", g.op("Mul", x, mask), [j], keepdims=False)
            del labels[j]
        return x, labels

    def _pair(
        self, a: Value, la: list[str], b: Value, lb: list[str], keep: set[str]
    ) -> tuple[Value, list[str]]:
        g = self.g
        batch = [c for c in la if c in lb and c in keep]
        contracted = [c for c in la if c in lb and c not in keep]
        a_only = [c for c in la if c not in lb]
        b_only = [c for c in lb if c not in la]
        nb, na, nc, nbo = len(batch), len(a_only), len(contracted), len(b_only)
        if not (contracted or a_only or b_only):
            # the same labels on both sides: elementwise
            return g.op("Mul", a, self._transpose(b, lb, la)), la
        # Otherwise one batched MatMul, also for outer products (an empty contraction is a
        # contraction over size 1): the engine loses the shape of a broadcasting Mul between
        # dims of different symbolic names and then cannot build its gradient.
        at = self._transpose(a, la, batch + a_only + contracted)
        bt = self._transpose(b, lb, batch + contracted + b_only)
        a_shape = _concat(
            g,
            _dims(g, at, 0, nb) if nb else _ints(g, []),
            _prod(g, _dims(g, at, nb, nb + na), na),
            _prod(g, _dims(g, at, nb + na, nb + na + nc), nc),
        )
        b_shape = _concat(
            g,
            _dims(g, bt, 0, nb) if nb else _ints(g, []),
            _prod(g, _dims(g, bt, nb, nb + nc), nc),
            _prod(g, _dims(g, bt, nb + nc), nbo),
        )
        product = g.op("MatMul", g.op("Reshape", at, a_shape), g.op("Reshape", bt, b_shape))
        out_shape = _concat(
            g,
            _dims(g, product, 0, nb) if nb else _ints(g, []),
            _dims(g, at, nb, nb + na) if na else _ints(g, []),
            _dims(g, bt, nb + nc) if nbo else _ints(g, []),
        )
        return g.op("Reshape", product, out_shape), batch + a_only + b_only


@sh.parse_args("s", "v", "is")
def einsum(g: Any, equation: str, tensor_list: Value, _path: list[int] | None = None) -> Value:
    return _Einsum(g, equation, sh._unpack_list(tensor_list)).run()


@sh.parse_args("v", "v")
def outer(g: Any, a: Value, b: Value) -> Value:
    # the default export is an Einsum, which the engine cannot differentiate
    if _scalar_type(b) != _scalar_type(a) and _scalar_type(a) in _FLOAT_TYPES:
        b = _cast(g, b, _float_type(a))
    return g.op("Mul", _unsqueeze(g, a, [1]), _unsqueeze(g, b, [0]))


# -- attention and dropout -------------------------------------------------------------------


def _dropout_train(g: Any, x: Value, p: float) -> Value:
    # Dropout with its mask output, so the gradient reuses the forward's mask.
    ratio = _const(g, p, _TORCH_TYPE[_float_type(x)])
    y, _mask = g.op("Dropout", x, ratio, _const(g, True, torch.bool), outputs=2)
    return y


@sh.parse_args("v", "v", "v", "v", "f", "b", "v", "b")
def scaled_dot_product_attention(
    g: Any,
    query: Value,
    key: Value,
    value: Value,
    attn_mask: Value = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Value = None,
    enable_gqa: bool = False,
) -> Value:
    # The default export's Dropout has no mask output, so no gradient graph can be built when
    # dropout_p > 0. Same math as eager: softmax(q k^T * scale + mask) -> dropout -> @ v.
    op = "aten::scaled_dot_product_attention"
    like = _float_type(query)
    dtype = _TORCH_TYPE[like]
    rank = _rank(key, op)
    if enable_gqa:
        key, value = _repeat_kv_heads(g, query, key, rank), _repeat_kv_heads(g, query, value, rank)
    perm = [*range(rank - 2), rank - 1, rank - 2]
    scores = g.op("MatMul", query, g.op("Transpose", key, perm_i=perm))
    scale_value = _const_float(scale)
    if scale_value is None:
        head = _cast(g, _dim(g, query, -1), like)
        factor = g.op("Reciprocal", g.op("Sqrt", head))
    else:
        factor = _const(g, [scale_value], dtype)
    scores = g.op("Mul", scores, factor)
    neg_inf = _const(g, float("-inf"), dtype)
    boolean_mask = False
    if is_causal:
        if not sh._is_none(attn_mask):
            raise ValueError(f"{op}: is_causal and attn_mask cannot be set together")
        attn_mask = _causal_mask(g, query, key)
    if not sh._is_none(attn_mask):
        if _scalar_type(attn_mask) == "Bool":
            boolean_mask = True
            scores = g.op("Where", attn_mask, scores, neg_inf)
        else:
            scores = g.op("Add", scores, attn_mask)
    attn = g.op("Softmax", scores, axis_i=-1)
    if boolean_mask:
        # eager gives a fully masked row zero weights instead of 0/0
        attn = g.op("Where", g.op("IsNaN", attn), _const(g, 0.0, dtype), attn)
    if dropout_p > 0.0:
        attn = _dropout_train(g, attn, dropout_p)
    return g.op("MatMul", attn, value)


def _const_float(v: Value) -> float | None:
    if v is None or sh._is_none(v):
        return None
    return float(sh._get_const(v, "f", "scale"))


def _causal_mask(g: Any, query: Value, key: Value) -> Value:
    """(L, S) bool, True where key position <= query position (top-left aligned like eager)."""
    zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
    rows = g.op("Range", zero, _dim_scalar(g, query, -2), one)
    cols = g.op("Range", zero, _dim_scalar(g, key, -2), one)
    return g.op("GreaterOrEqual", _unsqueeze(g, rows, [1]), _unsqueeze(g, cols, [0]))


def _repeat_kv_heads(g: Any, query: Value, kv: Value, rank: int) -> Value:
    """repeat_interleave of the head axis (-3) up to the query's head count (enable_gqa)."""
    head_axis = rank - 3
    repeats = g.op("Div", _dim(g, query, head_axis), _dim(g, kv, head_axis))
    expanded = g.op(
        "Expand",
        _unsqueeze(g, kv, [head_axis + 1]),
        _concat(g, _dims(g, kv, 0, head_axis + 1), repeats, _dims(g, kv, head_axis + 1)),
    )
    return g.op(
        "Reshape",
        expanded,
        _concat(
            g, _dims(g, kv, 0, head_axis), _dim(g, query, head_axis), _dims(g, kv, head_axis + 1)
        ),
    )


@sh.parse_args("v", "f", "b")
def feature_dropout(g: Any, x: Value, p: float, train: bool) -> Value:
    # Dropout2d/3d: the default export refuses training mode. One Dropout over a ones tensor of
    # shape (N, C, 1, ...) gives the scaled per-channel mask; x * mask differentiates through
    # Mul with that same mask.
    if not train or p == 0.0:
        return x
    rank = _rank(x, "aten::feature_dropout")
    ones_shape = _concat(g, _dims(g, x, 0, 2), _ints(g, [1] * (rank - 2)))
    ones = g.op(
        "ConstantOfShape",
        ones_shape,
        value_t=torch.tensor([1.0], dtype=_TORCH_TYPE[_float_type(x)]),
    )
    return g.op("Mul", x, _dropout_train(g, ones, p))


# -- convolution -----------------------------------------------------------------------------


def _default_convolution() -> Any:
    from torch.onnx import symbolic_opset9

    return symbolic_opset9._convolution


def _with_float_compute(g: Any, x: Value, weight: Value, bias: Value, build: Any) -> Value:
    """ONNX Conv has no bfloat16 type before opset 22 and the CPU engine no bfloat16 kernel:
    compute in float32 between casts (the casts differentiate back to bfloat16)."""
    if _scalar_type(x) != "BFloat16":
        return build(x, weight, bias)
    x = _cast(g, x, "Float")
    weight = _cast(g, weight, "Float")
    if not sh._is_none(bias):
        bias = _cast(g, bias, "Float")
    return _cast(g, build(x, weight, bias), "BFloat16")


@sh.parse_args("v", "v", "v", "is", "is", "is", "i", "is", "i", "i", "i", "i", "i")
def convolution(
    g: Any,
    x: Value,
    weight: Value,
    bias: Value,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    transposed: int,
    output_padding: list[int],
    groups: int,
    benchmark: int,
    deterministic: int,
    cudnn_enabled: int,
    allow_tf32: int | None = None,
) -> Value:
    def build(x: Value, weight: Value, bias: Value) -> Value:
        if transposed and _device_type(x) != "cuda":
            # the CPU engine has no ConvTransposeGrad kernel
            return _conv_transpose_as_conv(
                g, x, weight, bias, stride, padding, dilation, output_padding, groups
            )
        # everything after the three tensors goes to PyTorch's own symbolic unchanged
        settings = (stride, padding, dilation, transposed, output_padding, groups)
        flags = (benchmark, deterministic, cudnn_enabled, allow_tf32)
        return _default_convolution()(g, x, weight, bias, *settings, *flags)

    return _with_float_compute(g, x, weight, bias, build)


@sh.parse_args("v", "v", "v", "is", "s", "is", "i")
def convolution_mode(
    g: Any,
    x: Value,
    weight: Value,
    bias: Value,
    stride: list[int],
    padding: str,
    dilation: list[int],
    groups: int,
) -> Value:
    # padding="same"/"valid": the default export's auto_pad=SAME_UPPER Conv gets a wrong input
    # gradient from the engine. Explicit pads (the extra one on the right, as eager pads) are
    # differentiated correctly.
    sizes = sh._get_tensor_sizes(weight)
    if sizes is None or any(s is None for s in sizes[2:]):
        raise ValueError("aten::_convolution_mode: the kernel size must be known at export time")
    kernel = [int(s) for s in sizes[2:]]
    n = len(kernel)
    dilation, stride = _per_dim(dilation, n, [1]), _per_dim(stride, n, [1])
    if padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        begin = [t // 2 for t in total]
        pads = begin + [t - b for t, b in zip(total, begin, strict=True)]
    elif padding == "valid":
        pads = [0] * (2 * n)
    else:
        raise ValueError(f"aten::_convolution_mode: unknown padding {padding!r}")

    def build(x: Value, weight: Value, bias: Value) -> Value:
        args = [x, weight] if sh._is_none(bias) else [x, weight, bias]
        return g.op(
            "Conv",
            *args,
            kernel_shape_i=kernel,
            strides_i=stride,
            pads_i=pads,
            dilations_i=dilation,
            group_i=groups,
        )

    return _with_float_compute(g, x, weight, bias, build)


def _conv_transpose_as_conv(
    g: Any,
    x: Value,
    weight: Value,
    bias: Value,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    output_padding: list[int],
    groups: int,
) -> Value:
    """ConvTranspose as a stride-1 Conv over the input with (stride - 1) zeros between
    elements and a flipped, channel-swapped kernel; every step has a CPU gradient."""
    op = "aten::_convolution"
    sizes = sh._get_tensor_sizes(weight)
    if sizes is None or any(s is None for s in sizes):
        raise ValueError(
            f"{op}: the transposed-convolution weight shape must be known at export time"
        )
    c_in, c_out_per_group, *kernel = (int(s) for s in sizes)
    n = len(kernel)

    stride, padding = _per_dim(stride, n, [1]), _per_dim(padding, n, [0])
    dilation, output_padding = _per_dim(dilation, n, [1]), _per_dim(output_padding, n, [0])
    rank = n + 2
    for i in range(n):
        axis = 2 + i
        if stride[i] > 1:
            x = _zero_stuff(g, x, axis, stride[i])
    begin = [dilation[i] * (kernel[i] - 1) - padding[i] for i in range(n)]
    end = [begin[i] + output_padding[i] for i in range(n)]
    grow = [0, 0, *(max(b, 0) for b in begin), 0, 0, *(max(e, 0) for e in end)]
    if any(grow):
        x = g.op("Pad", x, _ints(g, grow))
    if any(b < 0 for b in begin) or any(e < 0 for e in end):
        axes = [2 + i for i in range(n)]
        starts = [max(-b, 0) for b in begin]
        stops = [e if e < 0 else _INT64_MAX for e in end]
        x = g.op("Slice", x, _ints(g, starts), _ints(g, stops), _ints(g, axes))
    # weight (C_in, C_out/G, k...) -> flipped (C_out, C_in/G, k...)
    w = weight
    for i in range(n):
        w = g.op("Gather", w, _ints(g, list(range(kernel[i] - 1, -1, -1))), axis_i=2 + i)
    w = g.op("Reshape", w, _ints(g, [groups, c_in // groups, c_out_per_group, *kernel]))
    w = g.op("Transpose", w, perm_i=[0, 2, 1, *range(3, rank + 1)])
    w = g.op("Reshape", w, _ints(g, [groups * c_out_per_group, c_in // groups, *kernel]))
    args = [x, w] if sh._is_none(bias) else [x, w, bias]
    return g.op(
        "Conv",
        *args,
        kernel_shape_i=kernel,
        strides_i=[1] * n,
        pads_i=[0] * (2 * n),
        dilations_i=dilation,
        group_i=groups,
    )


def _zero_stuff(g: Any, x: Value, axis: int, stride: int) -> Value:
    """Insert (stride - 1) zeros between consecutive elements along ``axis``."""
    rank = _rank(x, "aten::_convolution")
    spread = _unsqueeze(g, x, [axis + 1])
    pads = [0] * (2 * (rank + 1))
    pads[rank + 1 + axis + 1] = stride - 1
    spread = g.op("Pad", spread, _ints(g, pads))
    merged_shape = _concat(g, _dims(g, x, 0, axis), _ints(g, [-1]), _dims(g, x, axis + 1))
    merged = g.op("Reshape", spread, merged_shape)
    length = g.op("Sub", g.op("Mul", _dim(g, x, axis), _ints(g, [stride])), _ints(g, [stride - 1]))
    return g.op("Slice", merged, _ints(g, [0]), length, _ints(g, [axis]))


# -- pooling ---------------------------------------------------------------------------------


def _max_pool(n: int, with_indices: bool) -> Any:
    @sh.parse_args("v", "is", "is", "is", "is", "i")
    def symbolic(
        g: Any,
        x: Value,
        kernel: list[int],
        stride: list[int],
        padding: list[int],
        dilation: list[int],
        ceil_mode: int,
    ) -> Any:
        # The engine's CPU MaxPoolGrad sizes its output from the static shape of the node, so
        # with dynamic dims it writes out of bounds. MaxPool only picks the indices here; the
        # values are gathered from the flattened input, and Gather's gradient scatters back.
        kernel = _per_dim(kernel, n)
        _, flat_indices = g.op(
            "MaxPool",
            x,
            kernel_shape_i=kernel,
            strides_i=_per_dim(stride, n, kernel),
            pads_i=_per_dim(padding, n) * 2,
            dilations_i=_per_dim(dilation, n, [1]),
            ceil_mode_i=ceil_mode,
            outputs=2,
        )
        values = g.op("Gather", g.op("Reshape", x, _ints(g, [-1])), flat_indices, axis_i=0)
        if not with_indices:
            return values
        # ONNX indices count over the whole tensor, eager's within one (n, c) plane
        plane = g.op("ReduceProd", _dims(g, x, 2), keepdims_i=0)
        return values, g.op("Mod", flat_indices, plane)

    return symbolic


def _avg_pool(n: int) -> Any:
    def symbolic(
        g: Any,
        x: Value,
        kernel: Value,
        stride: Value,
        padding: Value,
        ceil_mode: Value,
        count_include_pad: Value,
        divisor_override: Value = None,
    ) -> Value:
        # The engine's CPU AveragePoolGrad sizes its output from the node's static shape (empty
        # with dynamic dims) and ignores ceil_mode. A window sum is a Conv with a ones kernel
        # over (N*C, 1, spatial...), which the engine differentiates; the divisor map counts
        # the cells eager counts.
        kernel_ = _per_dim(_const_ints(kernel) or [], n)
        stride_ = _per_dim(_const_ints(stride) or [], n, kernel_)
        pad_ = _per_dim(_const_ints(padding) or [0], n)
        ceil = bool(sh._get_const(ceil_mode, "i", "ceil_mode"))
        include_pad = bool(sh._get_const(count_include_pad, "i", "count_include_pad"))
        divisor = (
            None
            if divisor_override is None or sh._is_none(divisor_override)
            else sh._get_const(divisor_override, "i", "divisor_override")
        )
        like = _float_type(x)
        dtype = _TORCH_TYPE[like]
        planes = g.op("Reshape", x, _concat(g, _ints(g, [-1, 1]), _dims(g, x, 2)))
        extra = _ceil_extra(g, x, kernel_, stride_, pad_) if ceil else None
        ones_kernel = g.op("Constant", value_t=torch.ones([1, 1, *kernel_], dtype=dtype))

        def window_sum(t: Value, pad_value: float, with_extra: bool) -> Value:
            begin = _ints(g, [0, 0, *pad_])
            end = _ints(g, [0, 0, *pad_])
            if with_extra and extra is not None:
                end = g.op("Add", end, _concat(g, _ints(g, [0, 0]), extra))
            padded = g.op("Pad", t, _concat(g, begin, end), _const(g, pad_value, dtype))
            return g.op("Conv", padded, ones_kernel, kernel_shape_i=kernel_, strides_i=stride_)

        sums = window_sum(planes, 0.0, True)
        if divisor is not None:
            out = g.op("Div", sums, _const(g, float(divisor), dtype))
        elif include_pad and not ceil:
            size = 1
            for k in kernel_:
                size *= k
            out = g.op("Div", sums, _const(g, float(size), dtype))
        else:
            cells = g.op(
                "ConstantOfShape",
                _concat(g, _ints(g, [1, 1]), _dims(g, x, 2)),
                value_t=torch.tensor([1.0], dtype=dtype),
            )
            if include_pad:  # padding counts, the ceil overhang does not
                cells = g.op(
                    "Pad", cells, _ints(g, [0, 0, *pad_, 0, 0, *pad_]), _const(g, 1.0, dtype)
                )
                end = _concat(g, _ints(g, [0, 0]), extra)
                cells = g.op(
                    "Pad", cells, _concat(g, _ints(g, [0] * (n + 2)), end), _const(g, 0.0, dtype)
                )
                counts = g.op("Conv", cells, ones_kernel, kernel_shape_i=kernel_, strides_i=stride_)
            else:
                counts = window_sum(cells, 0.0, True)
            out = g.op("Div", sums, counts)
        return g.op("Reshape", out, _concat(g, _dims(g, x, 0, 2), _dims(g, out, 2)))

    return symbolic


def _ceil_extra(
    g: Any, x: Value, kernel: list[int], stride: list[int], padding: list[int]
) -> Value:
    """Right padding that makes a floor-mode window count equal eager's ceil-mode count:
    out = ceil((in + 2p - k) / s) + 1, less one when the last window starts past in + p."""
    sizes = _dims(g, x, 2)
    k, s, p = _ints(g, kernel), _ints(g, stride), _ints(g, padding)
    span = g.op("Sub", g.op("Add", sizes, g.op("Mul", p, _ints(g, [2] * len(kernel)))), k)
    out = g.op(
        "Add",
        g.op("Div", g.op("Add", span, g.op("Sub", s, _ints(g, [1] * len(kernel)))), s),
        _ints(g, [1] * len(kernel)),
    )
    last_start = g.op("Mul", g.op("Sub", out, _ints(g, [1] * len(kernel))), s)
    past = g.op("GreaterOrEqual", last_start, g.op("Add", sizes, p))
    out = g.op("Sub", out, _cast(g, past, "Long"))
    needed = g.op("Add", g.op("Mul", g.op("Sub", out, _ints(g, [1] * len(kernel))), s), k)
    have = g.op("Add", sizes, g.op("Mul", p, _ints(g, [2] * len(kernel))))
    return g.op("Max", g.op("Sub", needed, have), _ints(g, [0] * len(kernel)))


def _adaptive_bounds(g: Any, in_size: Value, out_size: int) -> tuple[Value, Value]:
    """Eager's adaptive window [start, end) per output cell, as int64 vectors of length out."""
    zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
    cells = g.op("Range", zero, _const(g, out_size, torch.int64), one)
    o = _const(g, out_size, torch.int64)
    start = g.op("Div", g.op("Mul", cells, in_size), o)
    end = g.op(
        "Div", g.op("Sub", g.op("Add", g.op("Mul", g.op("Add", cells, one), in_size), o), one), o
    )
    return start, end


def _adaptive_avg_pool(n: int) -> Any:
    @sh.parse_args("v", "is")
    def symbolic(g: Any, x: Value, output_size: list[int]) -> Value:
        # The default export works only for output size 1 (GlobalAveragePool). Each spatial
        # axis is an (out, in) averaging matrix applied with MatMul, built from the run-time
        # input size.
        rank = _rank(x, f"aten::adaptive_avg_pool{n}d")
        sizes = _per_dim(output_size, n)
        if all(s == 1 for s in sizes):
            return g.op("GlobalAveragePool", x)
        like = _float_type(x)
        zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
        y = x
        for i, out in enumerate(sizes):
            axis = rank - n + i
            in_size = _dim_scalar(g, x, axis)
            start, end = _adaptive_bounds(g, in_size, out)
            j = _unsqueeze(g, g.op("Range", zero, in_size, one), [0])
            inside = g.op(
                "And",
                g.op("GreaterOrEqual", j, _unsqueeze(g, start, [1])),
                g.op("Less", j, _unsqueeze(g, end, [1])),
            )
            width = _cast(g, _unsqueeze(g, g.op("Sub", end, start), [1]), like)
            matrix = g.op("Div", _cast(g, inside, like), width)  # (out, in)
            y = _along_axis(g, y, matrix, axis, rank)
        return y

    return symbolic


def _along_axis(g: Any, x: Value, matrix: Value, axis: int, rank: int) -> Value:
    """Apply an (out, in) matrix to ``axis`` of x."""
    if axis == rank - 1:
        return g.op("MatMul", x, g.op("Transpose", matrix, perm_i=[1, 0]))
    if axis == rank - 2:
        return g.op("MatMul", matrix, x)
    perm = list(range(rank))
    perm[axis], perm[-1] = perm[-1], perm[axis]
    moved = g.op(
        "MatMul", g.op("Transpose", x, perm_i=perm), g.op("Transpose", matrix, perm_i=[1, 0])
    )
    return g.op("Transpose", moved, perm_i=perm)


def _adaptive_max_pool(n: int) -> Any:
    @sh.parse_args("v", "is")
    def symbolic(g: Any, x: Value, output_size: list[int]) -> tuple[Value, Value]:
        # The default export has no gradient (GlobalMaxPool) or fails with dynamic dims. The
        # argmax of each window is found axis by axis (last axis first, so ties resolve to the
        # first element in row-major order as in eager); the values are then gathered from the
        # flattened input, and Gather's gradient routes each cell's gradient to its argmax.
        rank = _rank(x, f"aten::adaptive_max_pool{n}d")
        sizes = _per_dim(output_size, n)
        zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
        reduced = x
        chosen: dict[int, Value] = {}  # spatial axis -> absolute index, shaped like `reduced`
        for i in reversed(range(n)):
            axis = rank - n + i
            in_size = _dim_scalar(g, x, axis)
            start, end = _adaptive_bounds(g, in_size, sizes[i])
            longest = _reduce(g, "ReduceMax", g.op("Sub", end, start), None, keepdims=False)
            offsets = _unsqueeze(g, g.op("Range", zero, longest, one), [0])
            window = g.op(
                "Min",
                g.op("Add", _unsqueeze(g, start, [1]), offsets),
                _unsqueeze(g, g.op("Sub", end, one), [1]),
            )
            gathered = g.op("Gather", reduced, window, axis_i=axis)  # (..., out, L, ...)
            values, local = g.op(
                "TopK", gathered, _ints(g, [1]), axis_i=axis + 1, largest_i=1, sorted_i=1, outputs=2
            )
            reduced = _squeeze(g, values, [axis + 1])
            local = _squeeze(g, local, [axis + 1])
            trailing = list(range(1, rank - axis))
            absolute = g.op("Add", local, _unsqueeze(g, start, trailing) if trailing else start)
            for done, index in chosen.items():
                chosen[done] = g.op("GatherElements", index, absolute, axis_i=axis)
            chosen[axis] = absolute
        plane = None
        for i in range(n):
            axis = rank - n + i
            index = chosen[axis]
            plane = (
                index
                if plane is None
                else g.op("Add", g.op("Mul", plane, _dim_scalar(g, x, axis)), index)
            )
        assert plane is not None
        plane_size = g.op("ReduceProd", _dims(g, x, rank - n), keepdims_i=0)
        leading = g.op("ReduceProd", _dims(g, x, 0, rank - n), keepdims_i=0)
        base = g.op("Mul", g.op("Range", zero, leading, one), plane_size)
        base = g.op("Reshape", base, _concat(g, _dims(g, x, 0, rank - n), _ints(g, [1] * n)))
        flat_index = g.op("Add", base, plane)
        values = g.op("Gather", g.op("Reshape", x, _ints(g, [-1])), flat_index, axis_i=0)
        return values, plane

    return symbolic


# -- upsampling ------------------------------------------------------------------------------


class _Upsample:
    """upsample_* as per-axis Gathers of source rows mixed by weights (the engine's Resize
    gradient has no CPU kernel). Index and weight arithmetic follows ATen's CPU kernels."""

    def __init__(self, g: Any, x: Value, n: int, mode: str, align_corners: bool) -> None:
        self.g, self.x, self.n, self.mode, self.align = g, x, n, mode, align_corners
        self.rank = _rank(x, f"aten::upsample ({mode})")
        self.like = _float_type(x)

    def run(self, out_sizes: list[Value | int], scales: list[float | None]) -> Value:
        y = self.x
        for i in range(self.n):
            axis = self.rank - self.n + i
            y = self._axis(y, axis, out_sizes[i], scales[i])
        return y

    def _axis(self, y: Value, axis: int, out_size: Value | int, scale: float | None) -> Value:
        g = self.g
        f32 = torch.float32
        in_size = _dim_scalar(g, self.x, axis)
        in_f = _cast(g, in_size, "Float")
        out = _const(g, out_size, torch.int64) if isinstance(out_size, int) else out_size
        out_f = _cast(g, out, "Float")
        zero, one = _const(g, 0, torch.int64), _const(g, 1, torch.int64)
        dst = _cast(g, g.op("Range", zero, out, one), "Float")
        last = g.op("Sub", in_size, one)
        if self.align and self.mode != "nearest":
            ratio = g.op(
                "Div",
                g.op("Sub", in_f, _const(g, 1.0, f32)),
                g.op("Sub", out_f, _const(g, 1.0, f32)),
            )
            ratio = g.op("Where", g.op("Greater", out, one), ratio, _const(g, 0.0, f32))
        elif scale is not None and scale > 0:
            ratio = _const(g, float(torch.tensor(1.0 / scale, dtype=torch.float32)), f32)
        else:
            ratio = g.op("Div", in_f, out_f)

        if self.mode in ("nearest", "nearest-exact"):
            src = dst if self.mode == "nearest" else g.op("Add", dst, _const(g, 0.5, f32))
            index = _cast(g, g.op("Floor", g.op("Mul", src, ratio)), "Long")
            return g.op("Gather", y, g.op("Min", index, last), axis_i=axis)

        if self.align:
            real = g.op("Mul", ratio, dst)
        else:
            real = g.op(
                "Sub",
                g.op("Mul", ratio, g.op("Add", dst, _const(g, 0.5, f32))),
                _const(g, 0.5, f32),
            )
            if self.mode == "linear":
                real = g.op("Max", real, _const(g, 0.0, f32))
        base = g.op("Min", _cast(g, g.op("Floor", real), "Long"), last)
        t = g.op("Sub", real, _cast(g, base, "Float"))
        t = g.op("Min", g.op("Max", t, _const(g, 0.0, f32)), _const(g, 1.0, f32))
        if self.mode == "linear":
            taps = [
                (base, g.op("Sub", _const(g, 1.0, f32), t)),
                (g.op("Min", g.op("Add", base, one), last), t),
            ]
        else:
            taps = [
                (
                    g.op(
                        "Min",
                        g.op("Max", g.op("Add", base, _const(g, k - 1, torch.int64)), zero),
                        last,
                    ),
                    w,
                )
                for k, w in enumerate(self._cubic_weights(t))
            ]
        trailing = list(range(1, self.rank - axis))
        total = None
        for index, weight in taps:
            weight = _cast(g, weight, self.like)
            if trailing:
                weight = _unsqueeze(g, weight, trailing)
            term = g.op("Mul", g.op("Gather", y, index, axis_i=axis), weight)
            total = term if total is None else g.op("Add", total, term)
        return total

    def _cubic_weights(self, t: Value) -> list[Value]:
        """Keys' cubic convolution weights with A = -0.75, as ATen."""
        g = self.g
        a = -0.75

        def c(v: float) -> Value:
            return _const(g, v, torch.float32)

        def near(x: Value) -> Value:  # |x| <= 1: ((A + 2) x - (A + 3)) x^2 + 1
            inner = g.op("Sub", g.op("Mul", c(a + 2), x), c(a + 3))
            return g.op("Add", g.op("Mul", g.op("Mul", inner, x), x), c(1.0))

        def far(x: Value) -> Value:  # 1 < |x| < 2: ((A x - 5A) x + 8A) x - 4A
            inner = g.op(
                "Add", g.op("Mul", g.op("Sub", g.op("Mul", c(a), x), c(5 * a)), x), c(8 * a)
            )
            return g.op("Sub", g.op("Mul", inner, x), c(4 * a))

        one_minus = g.op("Sub", c(1.0), t)
        return [
            far(g.op("Add", t, c(1.0))),
            near(t),
            near(one_minus),
            far(g.op("Add", one_minus, c(1.0))),
        ]


def _upsample(n: int, mode: str) -> Any:
    def symbolic(g: Any, x: Value, output_size: Value, *args: Value) -> Value:
        # aten::upsample_*: (input, output_size, [align_corners,] scale_factors) for the .vec
        # overload, or per-axis optional scales for the sized overload.
        if mode in ("linear", "cubic"):
            align = bool(sh._get_const(args[0], "b", "align_corners"))
            rest = args[1:]
        else:
            align, rest = False, args
        scales = _upsample_scales(rest, n)
        sizes = _upsample_sizes(g, x, output_size, scales, n)
        return _Upsample(g, x, n, mode, align).run(sizes, scales)

    return symbolic


def _upsample_scales(args: Sequence[Value], n: int) -> list[float | None]:
    """Per-axis scale factors: one float list (the .vec overload) or one optional per axis."""
    if len(args) == 1:
        v = args[0]
        if v is None or sh._is_none(v):
            return [None] * n
        parsed = sh._maybe_get_const(v, "fs")
        if not isinstance(parsed, list):
            raise ValueError("aten::upsample: scale factors must be constants")
        scales: list[float | None] = [float(s) for s in parsed]
        return scales * n if len(scales) == 1 else scales
    return [
        None if a is None or sh._is_none(a) else float(sh._get_const(a, "f", "scale"))
        for a in args[-n:]
    ]


def _upsample_sizes(
    g: Any, x: Value, output_size: Value, scales: list[float | None], n: int
) -> list[Value | int]:
    rank = _rank(x, "aten::upsample")
    if output_size is not None and not sh._is_none(output_size):
        constant = _const_ints(output_size)
        if constant is not None:
            return constant * n if len(constant) == 1 else list(constant)
        if sh._is_packed_list(output_size):
            return [
                g.op("Reshape", _cast(g, v, "Long"), _ints(g, []))
                for v in sh._unpack_list(output_size)
            ]
        return [g.op("Gather", output_size, _const(g, i, torch.int64)) for i in range(n)]
    sizes: list[Value | int] = []
    for i, scale in enumerate(scales):
        if scale is None:
            raise ValueError("aten::upsample: needs an output size or scale factors")
        in_size = _cast(g, _dim_scalar(g, x, rank - n + i), "Double")
        scaled = g.op("Floor", g.op("Mul", in_size, _const(g, scale, torch.float64)))
        sizes.append(_cast(g, scaled, "Long"))
    return sizes


# -- registration ----------------------------------------------------------------------------


def register_builtin_symbolics() -> None:
    """Register every symbolic above (called on import of ``ortmodule_exporter``)."""
    # LayerNormalization is an ONNX operator from opset 17 (the engine also accepts it earlier,
    # but below 17 the default decomposition is differentiable as it is)
    register_symbolic("aten::layer_norm", layer_norm, 17)
    register_symbolic("aten::group_norm", group_norm, 14)
    register_symbolic("aten::gelu", gelu, 20)
    builtins: dict[str, Any] = {
        "aten::cross_entropy_loss": cross_entropy_loss,
        "aten::nll_loss": nll_loss,
        "aten::nll_loss2d": nll_loss,
        "aten::nll_loss_nd": nll_loss,
        "aten::embedding": embedding,
        "aten::softmax": softmax,
        "aten::log_softmax": log_softmax,
        "aten::max": _max_min(largest=True),
        "aten::min": _max_min(largest=False),
        "aten::amax": _amax_amin(largest=True),
        "aten::amin": _amax_amin(largest=False),
        "aten::squeeze": squeeze,
        "aten::einsum": einsum,
        "aten::outer": outer,
        "aten::scaled_dot_product_attention": scaled_dot_product_attention,
        "aten::feature_dropout": feature_dropout,
        "aten::_convolution": convolution,
        "aten::_convolution_mode": convolution_mode,
    }
    for n in (1, 2, 3):
        builtins[f"aten::max_pool{n}d"] = _max_pool(n, with_indices=False)
        builtins[f"aten::max_pool{n}d_with_indices"] = _max_pool(n, with_indices=True)
        builtins[f"aten::avg_pool{n}d"] = _avg_pool(n)
        builtins[f"aten::adaptive_avg_pool{n}d"] = _adaptive_avg_pool(n)
        builtins[f"aten::adaptive_max_pool{n}d"] = _adaptive_max_pool(n)
        builtins[f"aten::upsample_nearest{n}d"] = _upsample(n, "nearest")
        builtins[f"aten::_upsample_nearest_exact{n}d"] = _upsample(n, "nearest-exact")
    builtins["aten::upsample_linear1d"] = _upsample(1, "linear")
    builtins["aten::upsample_bilinear2d"] = _upsample(2, "linear")
    builtins["aten::upsample_trilinear3d"] = _upsample(3, "linear")
    builtins["aten::upsample_bicubic2d"] = _upsample(2, "cubic")
    for op, fn in builtins.items():
        register_symbolic(op, fn, 14)
