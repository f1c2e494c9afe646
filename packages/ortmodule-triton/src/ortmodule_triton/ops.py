"""What each supported ONNX op becomes in a generated kernel.

A handler takes the emitter, the node and its input values and returns its output values.
Elementwise ops work on any kind of value; reductions (``ReduceSum``, ``Softmax``,
``LayerNormalization``, their gradients, ...) reduce a per-element value over the trailing axes
that one program covers (the row template, see :mod:`ortmodule_triton.codegen`).

Triton's interpreter has no ``libdevice``, so ``tanh`` and ``pow`` are written with ``exp`` and
``log``; the same source then runs on CUDA and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import onnx

from .emitter import FLOAT_TYPES, KIND_ORDER, Emitter, Val, triton_type
from .errors import TritonCodegenError

__all__ = ["MS_DOMAIN", "OPS", "REDUCING_OPS", "OpContext", "reduced_axes", "supported_ops"]

TP = onnx.TensorProto
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class OpContext:
    """What a handler may read besides its inputs."""

    node: onnx.NodeProto
    opset: int
    #: the axes the node reduces (reducing ops only), normalised
    reduced: tuple[int, ...] = ()

    def attr(self, name: str, default: object = None) -> object:
        for a in self.node.attribute:
            if a.name == name:
                return onnx.helper.get_attribute_value(a)
        return default

    def where(self) -> str:
        return f"node {self.node.name or '<unnamed>'} ({self.node.op_type})"


Handler = Callable[[Emitter, OpContext, list[Val | None]], list[Val | None]]


def _kind(*vals: Val) -> str:
    return max((v.kind for v in vals), key=KIND_ORDER.__getitem__)


def _rank(*vals: Val) -> int:
    return max(v.rank for v in vals)


def _check_row_alignment(ctx: OpContext, vals: Sequence[Val]) -> None:
    """A reduced value without its kept dims would broadcast against the wrong axes."""
    full = [v for v in vals if v.kind == "full"]
    if not full:
        return
    for v in vals:
        if v.kind == "row" and v.rank < _rank(*full):
            raise TritonCodegenError(
                f"{ctx.where()}: combines a reduction computed with keepdims=0 with a full tensor; "
                "only reductions with keepdims=1 can be broadcast back inside one kernel"
            )


def _need(ctx: OpContext, ins: list[Val | None], count: int) -> list[Val]:
    got = [v for v in ins[:count] if v is not None]
    if len(got) < count:
        raise TritonCodegenError(f"{ctx.where()}: needs {count} inputs, got {len(got)}")
    return got


def _float_only(ctx: OpContext, vals: Sequence[Val]) -> None:
    for v in vals:
        if not v.is_float:
            raise TritonCodegenError(
                f"{ctx.where()}: needs floating-point inputs, got "
                f"{onnx.helper.tensor_dtype_to_string(v.dtype)}"
            )


def _binary(fmt: str, *, floats: bool = False, out_type: int | None = None) -> Handler:
    def handler(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
        a, b = _need(ctx, ins, 2)
        if floats:
            _float_only(ctx, (a, b))
        _check_row_alignment(ctx, (a, b))
        dtype = out_type if out_type is not None else (a.dtype if a.kind != "const" else b.dtype)
        return [em.value(fmt.format(a=a.expr, b=b.expr), dtype, _kind(a, b), _rank(a, b))]

    return handler


def _unary(fmt: str, *, floats: bool = True) -> Handler:
    def handler(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
        (x,) = _need(ctx, ins, 1)
        if floats:
            _float_only(ctx, (x,))
        return [em.value(fmt.format(x=x.expr), x.dtype, x.kind, x.rank)]

    return handler


def _tanh(em: Emitter, x: str) -> str:
    # tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): no overflow, no cancellation near 0
    # beyond fp32's own (Triton's interpreter has no libdevice.tanh)
    e = em.fresh(f"tl.exp(-2.0 * tl.abs({x}))")
    t = em.fresh(f"(1.0 - {e}) / (1.0 + {e})")
    return f"tl.where({x} < 0, -{t}, {t})"


def _tanh_op(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    (x,) = _need(ctx, ins, 1)
    _float_only(ctx, (x,))
    return [em.value(_tanh(em, x.expr), x.dtype, x.kind, x.rank)]


def _pow(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    a, b = _need(ctx, ins, 2)
    _float_only(ctx, (a,))
    _check_row_alignment(ctx, (a, b))
    x = a.expr
    if b.kind == "const" and b.literal is not None:
        c = float(b.literal)
        if c == int(c) and abs(c) <= 8:
            n = abs(int(c))
            expr = "1.0" if n == 0 else " * ".join([x] * n)
            expr = f"(1.0 / ({expr}))" if c < 0 else f"({expr})"
        elif c == 0.5:
            expr = f"tl.sqrt({x})"
        elif c == -0.5:
            expr = f"(1.0 / tl.sqrt({x}))"
        else:
            # a non-integer power of a negative base is NaN in ONNX too
            expr = f"tl.exp({c!r} * tl.log({x}))"
    else:
        expr = f"tl.exp(({b.expr}) * tl.log({x}))"
    return [em.value(expr, a.dtype, _kind(a, b), _rank(a, b))]


def _where(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    c, a, b = _need(ctx, ins, 3)
    _check_row_alignment(ctx, (c, a, b))
    dtype = a.dtype if a.kind != "const" else b.dtype
    expr = f"tl.where({c.expr}, {a.expr}, {b.expr})"
    return [em.value(expr, dtype, _kind(c, a, b), _rank(c, a, b))]


def _cast(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    (x,) = _need(ctx, ins, 1)
    to = int(ctx.attr("to"))  # type: ignore[call-overload]
    if to in FLOAT_TYPES:
        expr = f"({x.expr}).to(tl.float32)"
    elif to == TP.BOOL:
        expr = f"({x.expr} != 0)"
    elif to in (TP.INT64, TP.INT32, TP.INT8, TP.UINT8):
        expr = f"({x.expr}).to({triton_type(to, ctx.where())})"
    else:
        raise TritonCodegenError(
            f"{ctx.where()}: Cast to {onnx.helper.tensor_dtype_to_string(to)} is not supported"
        )
    return [em.value(expr, to, x.kind, x.rank)]


def _identity(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    (x,) = _need(ctx, ins, 1)
    return [x]


def _erf_gelu(x: str) -> str:
    return f"(0.5 * {x} * (1.0 + tl.math.erf({x} * {math.sqrt(0.5)!r})))"


def _tanh_gelu(em: Emitter, x: str) -> str:
    inner = em.fresh(f"{math.sqrt(2.0 / math.pi)!r} * ({x} + 0.044715 * {x} * {x} * {x})")
    return f"(0.5 * {x} * (1.0 + {_tanh(em, inner)}))"


def _gelu(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    (x,) = _need(ctx, ins, 1)
    _float_only(ctx, (x,))
    approx = ctx.attr("approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else str(approx)
    if approx not in ("none", "tanh"):
        raise TritonCodegenError(f"{ctx.where()}: approximate={approx!r} is not 'none' or 'tanh'")
    expr = _erf_gelu(x.expr) if approx == "none" else _tanh_gelu(em, x.expr)
    return [em.value(expr, x.dtype, x.kind, x.rank)]


def _biased(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> Val:
    x = _need(ctx, ins, 1)[0]
    bias = ins[1] if len(ins) > 1 else None
    if bias is None:
        return x
    _check_row_alignment(ctx, (x, bias))
    return em.value(f"{x.expr} + {bias.expr}", x.dtype, _kind(x, bias), _rank(x, bias))


def _bias_gelu(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    x = _biased(em, ctx, ins)
    _float_only(ctx, (x,))
    return [em.value(_erf_gelu(x.expr), x.dtype, x.kind, x.rank)]


def _fast_gelu(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    x = _biased(em, ctx, ins)
    _float_only(ctx, (x,))
    return [em.value(_tanh_gelu(em, x.expr), x.dtype, x.kind, x.rank)]


def _erf_gelu_grad(em: Emitter, dy: str, x: str) -> str:
    # d/dx x Phi(x) = Phi(x) + x phi(x)
    cdf = em.fresh(f"0.5 * (1.0 + tl.math.erf({x} * {math.sqrt(0.5)!r}))")
    pdf = em.fresh(f"tl.exp(-0.5 * {x} * {x}) * {1.0 / math.sqrt(2.0 * math.pi)!r}")
    return f"{dy} * ({cdf} + {x} * {pdf})"


def _gelu_grad(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    dy, x = _need(ctx, ins, 2)
    if len(ins) > 2 and ins[2] is not None:  # BiasGeluGrad_dX(dY, X, B)
        x = em.value(f"{x.expr} + {ins[2].expr}", x.dtype, _kind(x, ins[2]), _rank(x, ins[2]))
    _float_only(ctx, (dy, x))
    _check_row_alignment(ctx, (dy, x))
    expr = _erf_gelu_grad(em, dy.expr, x.expr)
    return [em.value(expr, dy.dtype, _kind(dy, x), _rank(dy, x))]


def _fast_gelu_grad(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    dy, x = _need(ctx, ins, 2)
    _float_only(ctx, (dy, x))
    k = math.sqrt(2.0 / math.pi)
    u = em.fresh(f"{k!r} * ({x.expr} + 0.044715 * {x.expr} * {x.expr} * {x.expr})")
    t = em.fresh(_tanh(em, u))
    du = f"{k!r} * (1.0 + 3.0 * 0.044715 * {x.expr} * {x.expr})"
    expr = f"{dy.expr} * (0.5 * (1.0 + {t}) + 0.5 * {x.expr} * (1.0 - {t} * {t}) * {du})"
    return [em.value(expr, dy.dtype, _kind(dy, x), _rank(dy, x))]


def _grad_by_output(fmt: str) -> Handler:
    """``ReluGrad(dY, X)``, ``SigmoidGrad(dY, Y)``, ``TanhGrad(dY, Y)`` of com.microsoft."""

    def handler(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
        dy, y = _need(ctx, ins, 2)
        _check_row_alignment(ctx, (dy, y))
        expr = fmt.format(dy=dy.expr, y=y.expr)
        return [em.value(expr, dy.dtype, _kind(dy, y), _rank(dy, y))]

    return handler


def _literal(ctx: OpContext, v: Val | None, what: str, default: float) -> float:
    if v is None:
        return default
    if v.kind != "const" or v.literal is None:
        raise TritonCodegenError(
            f"{ctx.where()}: {what} must be a constant scalar (an initializer or Constant) for "
            "the generated kernel"
        )
    return float(v.literal)


def _dropout(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    x = _need(ctx, ins, 1)[0]
    _float_only(ctx, (x,))
    ratio = _literal(ctx, ins[1] if len(ins) > 1 else None, "ratio", 0.5)
    training = bool(_literal(ctx, ins[2] if len(ins) > 2 else None, "training_mode", 0.0))
    if x.kind != "full":
        raise TritonCodegenError(f"{ctx.where()}: dropout of a reduced value is not supported")
    if not training or ratio == 0.0:
        return [x, em.value("mask | True", TP.BOOL, "full", x.rank)]
    if not 0.0 <= ratio < 1.0:
        raise TritonCodegenError(f"{ctx.where()}: ratio {ratio} is outside [0, 1)")
    seed_attr = ctx.attr("seed")
    seed = em.seed(int(seed_attr) if seed_attr is not None else None)  # type: ignore[call-overload]
    keep = em.value(f"tl.rand({seed}, flat.to(tl.int32)) >= {ratio!r}", TP.BOOL, "full", x.rank)
    out = em.value(
        f"tl.where({keep.expr}, {x.expr} * {1.0 / (1.0 - ratio)!r}, 0.0)", x.dtype, "full", x.rank
    )
    return [out, keep]


def _dropout_grad(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    dy, mask = _need(ctx, ins, 2)
    ratio = _literal(ctx, ins[2] if len(ins) > 2 else None, "ratio", 0.5)
    training = bool(_literal(ctx, ins[3] if len(ins) > 3 else None, "training_mode", 1.0))
    scale = 1.0 / (1.0 - ratio) if training else 1.0
    expr = f"tl.where({mask.expr}, {dy.expr} * {scale!r}, 0.0)"
    return [em.value(expr, dy.dtype, _kind(dy, mask), _rank(dy, mask))]


# -- reductions over the trailing axes (row template) -------------------------------------------


def _full(ctx: OpContext, em: Emitter, *vals: Val) -> None:
    if not em.reduced:
        raise TritonCodegenError(f"{ctx.where()}: a reduction outside the row template")
    for v in vals:
        if v.kind != "full":
            raise TritonCodegenError(
                f"{ctx.where()}: reduces a value that is already reduced; one kernel reduces "
                "each element once over the trailing axes"
            )


def _sum(x: str) -> str:
    return f"tl.sum(tl.where(mask, {x}, 0.0), axis=1, keep_dims=True)"


def _max(x: str) -> str:
    return f"tl.max(tl.where(mask, {x}, float('-inf')), axis=1, keep_dims=True)"


def _reduce(how: str) -> Handler:
    def handler(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
        x = _need(ctx, ins, 1)[0]
        _full(ctx, em, x)
        keep = bool(ctx.attr("keepdims", 1))
        rank = x.rank if keep else x.rank - len(ctx.reduced)
        if x.dtype in FLOAT_TYPES:
            zero, low = "0.0", "float('-inf')"
        else:
            zero, low = "0", "-9223372036854775807"
        if how == "max":
            expr = f"tl.max(tl.where(mask, {x.expr}, {low}), axis=1, keep_dims=True)"
        else:
            expr = f"tl.sum(tl.where(mask, {x.expr}, {zero}), axis=1, keep_dims=True)"
            if how == "mean":
                expr = f"{expr} / N"
        return [em.value(expr, x.dtype, "row", rank)]

    return handler


def _softmax(log: bool) -> Handler:
    def handler(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
        x = _need(ctx, ins, 1)[0]
        _float_only(ctx, (x,))
        _full(ctx, em, x)
        m = em.fresh(_max(x.expr))
        shifted = em.fresh(f"{x.expr} - {m}")
        e = em.fresh(f"tl.exp({shifted})")
        s = em.fresh(_sum(e))
        expr = f"{shifted} - tl.log({s})" if log else f"{e} / {s}"
        return [em.value(expr, x.dtype, "full", x.rank)]

    return handler


def _softmax_grad(log: bool) -> Handler:
    def handler(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
        dy, y = _need(ctx, ins, 2)
        _float_only(ctx, (dy, y))
        _full(ctx, em, dy, y)
        if log:  # y = log_softmax(x): dx = dy - exp(y) * sum(dy)
            s = em.fresh(_sum(dy.expr))
            expr = f"{dy.expr} - tl.exp({y.expr}) * {s}"
        else:  # dx = y * (dy - sum(dy * y))
            s = em.fresh(_sum(f"{dy.expr} * {y.expr}"))
            expr = f"{y.expr} * ({dy.expr} - {s})"
        return [em.value(expr, dy.dtype, "full", dy.rank)]

    return handler


def _layer_norm(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    x, scale = _need(ctx, ins, 2)
    bias = ins[2] if len(ins) > 2 else None
    _float_only(ctx, (x, scale))
    _full(ctx, em, x)
    eps = float(ctx.attr("epsilon", 1e-5))  # type: ignore[arg-type]
    mean = em.fresh(f"{_sum(x.expr)} / N")
    centered = em.fresh(f"{x.expr} - {mean}")
    var = em.fresh(f"{_sum(f'{centered} * {centered}')} / N")
    inv = em.fresh(f"1.0 / tl.sqrt({var} + {eps!r})")
    y = f"{centered} * {inv} * {scale.expr}"
    if bias is not None:
        y = f"{y} + {bias.expr}"
    stash = int(ctx.attr("stash_type", TP.FLOAT))  # type: ignore[call-overload]
    return [
        em.value(y, x.dtype, "full", x.rank),
        em.value(mean, stash, "row", x.rank),
        em.value(inv, stash, "row", x.rank),
    ]


def _layer_norm_grad(em: Emitter, ctx: OpContext, ins: list[Val | None]) -> list[Val | None]:
    """com.microsoft LayerNormalizationGrad(Y_grad, X, scale, mean, inv_std_dev)."""
    dy, x, scale, mean, inv = _need(ctx, ins, 5)
    _float_only(ctx, (dy, x, scale))
    _full(ctx, em, dy, x)
    xhat = em.fresh(f"({x.expr} - {mean.expr}) * {inv.expr}")
    g = em.fresh(f"{dy.expr} * {scale.expr}")
    mg = em.fresh(f"{_sum(g)} / N")
    mgx = em.fresh(f"{_sum(f'{g} * {xhat}')} / N")
    dx = f"{inv.expr} * ({g} - {mg} - {xhat} * {mgx})"
    # scale and bias gradients sum over the rows: every program adds its row (atomic, fp32)
    return [
        em.value(dx, dy.dtype, "full", dy.rank),
        Val(em.fresh(f"{dy.expr} * {xhat}"), scale.dtype, "col", scale.rank),
        Val(em.fresh(f"{dy.expr} + 0.0"), scale.dtype, "col", scale.rank),
    ]


OPS: dict[tuple[str, str], Handler] = {
    ("", "Add"): _binary("{a} + {b}"),
    ("", "Sub"): _binary("{a} - {b}"),
    ("", "Mul"): _binary("{a} * {b}"),
    ("", "Div"): _binary("{a} / {b}", floats=True),
    ("", "Pow"): _pow,
    ("", "Max"): _binary("tl.maximum({a}, {b})"),
    ("", "Min"): _binary("tl.minimum({a}, {b})"),
    ("", "Equal"): _binary("{a} == {b}", out_type=TP.BOOL),
    ("", "Less"): _binary("{a} < {b}", out_type=TP.BOOL),
    ("", "LessOrEqual"): _binary("{a} <= {b}", out_type=TP.BOOL),
    ("", "Greater"): _binary("{a} > {b}", out_type=TP.BOOL),
    ("", "GreaterOrEqual"): _binary("{a} >= {b}", out_type=TP.BOOL),
    ("", "And"): _binary("{a} & {b}", out_type=TP.BOOL),
    ("", "Or"): _binary("{a} | {b}", out_type=TP.BOOL),
    ("", "Xor"): _binary("{a} ^ {b}", out_type=TP.BOOL),
    ("", "Not"): _unary("{x} == 0", floats=False),
    ("", "Neg"): _unary("-{x}", floats=False),
    ("", "Abs"): _unary("tl.abs({x})", floats=False),
    ("", "Reciprocal"): _unary("1.0 / {x}"),
    ("", "Sqrt"): _unary("tl.sqrt({x})"),
    ("", "Exp"): _unary("tl.exp({x})"),
    ("", "Log"): _unary("tl.log({x})"),
    ("", "Erf"): _unary("tl.math.erf({x})"),
    ("", "Sigmoid"): _unary("tl.sigmoid({x})"),
    ("", "Relu"): _unary("tl.maximum({x}, 0.0)"),
    ("", "Tanh"): _tanh_op,
    ("", "Gelu"): _gelu,
    ("", "Where"): _where,
    ("", "Cast"): _cast,
    ("", "Identity"): _identity,
    ("", "Dropout"): _dropout,
    ("", "ReduceSum"): _reduce("sum"),
    ("", "ReduceMean"): _reduce("mean"),
    ("", "ReduceMax"): _reduce("max"),
    ("", "Softmax"): _softmax(log=False),
    ("", "LogSoftmax"): _softmax(log=True),
    ("", "LayerNormalization"): _layer_norm,
    (MS_DOMAIN, "Gelu"): _gelu,
    (MS_DOMAIN, "BiasGelu"): _bias_gelu,
    (MS_DOMAIN, "FastGelu"): _fast_gelu,
    (MS_DOMAIN, "GeluGrad"): _gelu_grad,
    (MS_DOMAIN, "BiasGeluGrad_dX"): _gelu_grad,
    (MS_DOMAIN, "FastGeluGrad"): _fast_gelu_grad,
    (MS_DOMAIN, "ReluGrad"): _grad_by_output("tl.where({y} > 0, {dy}, 0.0)"),
    (MS_DOMAIN, "SigmoidGrad"): _grad_by_output("{dy} * {y} * (1.0 - {y})"),
    (MS_DOMAIN, "TanhGrad"): _grad_by_output("{dy} * (1.0 - {y} * {y})"),
    (MS_DOMAIN, "DropoutGrad"): _dropout_grad,
    (MS_DOMAIN, "SoftmaxGrad_13"): _softmax_grad(log=False),
    (MS_DOMAIN, "LogSoftmaxGrad_13"): _softmax_grad(log=True),
    (MS_DOMAIN, "LayerNormalizationGrad"): _layer_norm_grad,
}

#: ops that reduce over trailing axes, so the kernel needs the row template
REDUCING_OPS = frozenset(
    {
        ("", "ReduceSum"),
        ("", "ReduceMean"),
        ("", "ReduceMax"),
        ("", "Softmax"),
        ("", "LogSoftmax"),
        ("", "LayerNormalization"),
        (MS_DOMAIN, "SoftmaxGrad_13"),
        (MS_DOMAIN, "LogSoftmaxGrad_13"),
        (MS_DOMAIN, "LayerNormalizationGrad"),
    }
)


def supported_ops() -> list[tuple[str, str]]:
    """(domain, op_type) of every op the code generator handles."""
    return sorted(OPS)


def reduced_axes(
    node: onnx.NodeProto, rank: int, opset: int, constant_axes: Sequence[int] | None
) -> list[int]:
    """The axes ``node`` (one of :data:`REDUCING_OPS`) reduces, normalised to ``0..rank-1``.

    ``constant_axes`` is the value of an ``axes`` input when the op takes it as an input.
    """
    ctx = OpContext(node, opset)
    op = node.op_type
    if op.startswith("Reduce"):
        axes = ctx.attr("axes")
        if axes is None:
            axes = constant_axes
        if not axes:
            if op == "ReduceSum" and ctx.attr("noop_with_empty_axes", 0):
                raise TritonCodegenError(f"{ctx.where()}: noop_with_empty_axes=1 is not supported")
            axes = list(range(rank))
        found = sorted(int(a) % rank for a in list(axes))  # type: ignore[call-overload]
    elif op in ("Softmax", "LogSoftmax"):
        axis = int(ctx.attr("axis", -1 if opset >= 13 else 1)) % rank  # type: ignore[call-overload]
        # before opset 13 the op flattens to 2-D at ``axis``: it reduces every trailing axis
        found = [axis] if opset >= 13 else list(range(axis, rank))
    elif op in ("SoftmaxGrad_13", "LogSoftmaxGrad_13"):
        found = [int(ctx.attr("axis", -1)) % rank]  # type: ignore[call-overload]
    else:  # LayerNormalization and its gradient normalise over [axis, rank)
        axis = int(ctx.attr("axis", -1)) % rank  # type: ignore[call-overload]
        found = list(range(axis, rank))
    return found
