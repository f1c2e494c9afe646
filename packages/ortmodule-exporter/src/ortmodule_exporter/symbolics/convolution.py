"""Convolution symbolics: ``_convolution`` and ``_convolution_mode``."""

from __future__ import annotations

from typing import Any

from ..torchscript_onnx import symbolic_helper as sh
from ..torchscript_onnx import symbolic_opset9
from .helpers import (
    _INT64_MAX,
    Value,
    _cast,
    _concat,
    _device_type,
    _dim,
    _dims,
    _ints,
    _per_dim,
    _rank,
    _scalar_type,
    _unsqueeze,
)

# -- convolution -----------------------------------------------------------------------------


def _default_convolution() -> Any:

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
