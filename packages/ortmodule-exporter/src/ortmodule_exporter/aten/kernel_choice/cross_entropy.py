"""Cross-entropy on class indices (mean or sum, no class weights or smoothing), where the labels
are dense enough that label sparsity leaves the loss whole (judged on the traced batch as that
pass judges it): the engine's ``SoftmaxCrossEntropyLoss`` and its gradient or PyTorch's
``log_softmax`` + ``nll_loss`` as ATen nodes. The padding pass asks
:func:`cross_entropy_route` too, and writes :func:`aten_cross_entropy`'s node.

>>> from ortmodule_exporter.aten.kernel_choice import measure_cross_entropy
>>> engine_us, torch_us = measure_cross_entropy(64, 32)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.numpy_helper
import torch

from ...label_density import DENSITY_THRESHOLD
from ...onnx_graph import attribute
from ...symbolics import losses
from ...torchscript_onnx import symbolic_helper as sh
from .. import parallel
from ..executor import ATEN_DOMAIN, AtenFunction, register_aten_function
from ..gradients import GradientNode, register_aten_gradient, register_stop_gradient_edges
from ..output_shapes import Shape, register_output_shapes
from .choice import _decide, _size_class
from .fx_nodes import (
    AtenChoice,
    fx_arg,
    fx_float32,
    fx_label_density,
    fx_needs_grad,
    fx_sizes,
    register_fx_kernel_choice,
)
from .helpers import _all_tensors, _aten_overload, _dtype, _ints_const
from .measuring import ATEN_NODE_US, _engine_us, _randn, _seeded, _torch_us
from .registry import CoveredOperator, register_kernel_choice
from .traced import _traced

CROSS_ENTROPY = "_ortmodule_cross_entropy"
CROSS_ENTROPY_BACKWARD = "_ortmodule_cross_entropy_backward"


#: ATen's reduction codes the route takes (``none`` keeps the engine's kernel)
_MEAN, _SUM = 1, 2


def _picked(target: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows that count (not ``ignore_index``) and each row's class, 0 for the others."""
    kept = target != ignore_index
    return kept, torch.where(kept, target, 0).unsqueeze(1)


#: elements of the logits one pass works on (2 MiB of float32, 10 rows of a 50257-class loss):
#: the shifted copy and its exponentials stay in cache from one pass to the next instead of
#: going through memory once per pass (1024 x 50257, forward and backward on one thread:
#: 323 -> 221 ms; 128 ms in two pieces, :func:`parallel.over_rows`; bitwise the same values)
_BLOCK = 1 << 19


def _blocks(start: int, stop: int, classes: int) -> list[tuple[int, int]]:
    step = max(1, _BLOCK // max(classes, 1))
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def _logsumexp_rows(logits: torch.Tensor, lse: torch.Tensor, start: int, stop: int) -> None:
    """Each row's logsumexp of ``logits[start:stop]`` into ``lse[start:stop]``, a block of rows
    at a time. log_softmax's own steps, not torch.logsumexp (which takes an infinite maximum as
    it is): a +inf logit makes its row NaN, as in eager."""
    blocks = _blocks(start, stop, logits.shape[1])
    if not blocks:
        return
    scratch = logits.new_empty((blocks[0][1] - blocks[0][0], logits.shape[1]))
    for a, b in blocks:
        x = logits[a:b]
        top = x.amax(1, keepdim=True)
        shifted = torch.sub(x, top, out=scratch[: b - a]).exp_()
        torch.sum(shifted, 1, out=lse[a:b])
        lse[a:b].log_().add_(top.squeeze(1))


def _cross_entropy(_overload: str, inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """F.cross_entropy on class indices (log_softmax, then nll_loss), keeping for the backward
    each row's logsumexp, not the (rows, classes) log-probabilities: the backward reads the
    logits, which the graph keeps anyway where they are an output (a causal LM's), so the
    step holds one tensor of the logits' size fewer (206 MB at GPT-2 124M, batch 4 x 256),
    and the forward writes none."""
    logits, target, params = inputs
    assert logits is not None and target is not None and params is not None
    reduction, ignore_index = params.tolist()
    rows = logits.shape[0]
    lse = logits.new_empty(rows)
    parallel.over_rows(
        lambda start, stop: _logsumexp_rows(logits, lse, start, stop), rows, logits.numel()
    )
    kept, classes = _picked(target, ignore_index)
    nll = torch.where(kept, lse - logits.gather(1, classes).squeeze(1), 0)
    total = kept.sum().to(logits.dtype)
    loss = nll.sum() if reduction == _SUM else nll.sum() / total
    return [loss, lse, total]


#: the overload of a :data:`CROSS_ENTROPY_BACKWARD` node that also adds the gradient autograd
#: hands in for the logits (``passes/output_grad_sums.py``)
ADDS_OUTPUT_GRAD = "adds_output_grad"


def cross_entropy_backward_overload(node: onnx.NodeProto) -> str | None:
    """The overload name of a :data:`CROSS_ENTROPY_BACKWARD` ATen node; None for another
    node."""
    return _aten_overload(node, CROSS_ENTROPY_BACKWARD)


def _onnx_shape(x: torch.Tensor, shape: torch.Tensor) -> list[int]:
    """ONNX ``Reshape``'s target (``allowzero=0``): a 0 keeps ``x``'s dim there."""
    return [int(x.shape[i]) if d == 0 else int(d) for i, d in enumerate(shape.tolist())]


def _cross_entropy_backward(
    overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """softmax(logits) - one_hot(target), scaled by the loss's gradient (divided by the
    counted rows for a mean), zero on ignored rows: ``nll_loss_backward`` and
    ``_log_softmax_backward_data`` in one tensor of the logits' size. :data:`ADDS_OUTPUT_GRAD`:
    two more inputs, the logits' gradient from outside the graph (a 0-d zero where the user
    did not use them) and the shape the graph reshapes this gradient to before adding it; it
    is added here, in place."""
    outside: torch.Tensor | None = None
    outside_shape: torch.Tensor | None = None
    if overload == ADDS_OUTPUT_GRAD:
        *inputs, outside, outside_shape = inputs
        assert outside is not None and outside_shape is not None
    grad, logits, lse, target, total, params = inputs
    assert grad is not None and logits is not None and lse is not None
    assert target is not None and total is not None and params is not None
    reduction, ignore_index = params.tolist()
    kept, classes = _picked(target, ignore_index)
    scale = grad / total if reduction == _MEAN else grad
    row = torch.where(kept, scale, 0).unsqueeze(1)
    grad_logits = torch.empty_like(logits, memory_format=torch.contiguous_format)

    def fill(start: int, stop: int) -> None:
        for a, b in _blocks(start, stop, logits.shape[1]):
            out = grad_logits[a:b]
            torch.sub(logits[a:b], lse[a:b].unsqueeze(1), out=out).exp_().mul_(row[a:b])

    parallel.over_rows(fill, logits.shape[0], logits.numel())
    grad_logits.scatter_add_(1, classes, row.neg())
    if outside is not None and (outside.numel() != 1 or bool(outside.reshape(()) != 0)):
        assert outside_shape is not None
        grad_logits.view(_onnx_shape(grad_logits, outside_shape)).add_(outside)
    return [grad_logits]


register_aten_function(CROSS_ENTROPY, AtenFunction(_cross_entropy, _all_tensors))
register_aten_function(CROSS_ENTROPY_BACKWARD, AtenFunction(_cross_entropy_backward, _all_tensors))
register_aten_gradient(
    CROSS_ENTROPY,
    "",
    [
        GradientNode.aten(
            CROSS_ENTROPY_BACKWARD, ["GO(0)", "I(0)", "O(1)", "I(1)", "O(2)", "I(2)"], ["GI(0)"]
        )
    ],
)
register_stop_gradient_edges(CROSS_ENTROPY, "", [1, 2])


def _cross_entropy_shapes(shapes: Sequence[Shape | None], _overload: str) -> list[Shape | None]:
    """The loss and the labelled count are scalars; the logsumexp has one value per row."""
    logits = shapes[0]
    return [[], [logits[0]] if logits is not None and len(logits) == 2 else None, []]


register_output_shapes(CROSS_ENTROPY, _cross_entropy_shapes)


def measure_cross_entropy(rows: int, classes: int) -> tuple[float, float]:
    """Microseconds of a mean cross-entropy over ``rows`` x ``classes`` logits, forward +
    backward: (engine, torch). Engine: ``SoftmaxCrossEntropyLoss`` and its gradient; PyTorch:
    ``log_softmax`` + ``nll_loss`` and their backwards, two ATen nodes."""
    from onnx import TensorProto, helper

    _seeded()
    logits = _randn(rows, classes)
    target = torch.randint(0, classes, (rows,), generator=_randn.gen)  # type: ignore[attr-defined]
    nodes = [
        helper.make_node(
            "SoftmaxCrossEntropyLoss", ["x", "t"], ["loss", "log_prob"], reduction="mean"
        ),
        helper.make_node(
            "SoftmaxCrossEntropyLossGrad",
            ["dloss", "log_prob", "t"],
            ["dx"],
            domain="com.microsoft",
            reduction="mean",
        ),
    ]
    feeds = {"x": logits, "t": target, "dloss": torch.tensor(1.0)}
    engine_us = _engine_us("cross_entropy", nodes, feeds, ["loss", "dx"], {"t": TensorProto.INT64})
    params = torch.tensor([_MEAN, -100])

    def torch_route() -> None:
        _loss, lse, total = _cross_entropy("", [logits, target, params])
        _cross_entropy_backward("", [torch.tensor(1.0), logits, lse, target, total, params])

    return engine_us, _torch_us(torch_route, engine_us=engine_us)


#: the most logits a cross-entropy calibration times (16 MiB of float32): both routes cost the
#: same per row, so a few rows of a 50257-class loss decide for 1024 (10 s of GPT-2 124M's
#: cold start measured 1024 x 50257)
CALIBRATION_LOGITS = 1 << 22
#: the fewest rows it times, so that every thread has rows to work on
_MIN_TIMED_ROWS = 16


def cross_entropy_route(rows: int, classes: int) -> str:
    """``"engine"`` or ``"torch"`` for a float32 mean or sum cross-entropy over ``rows`` x
    ``classes`` logits and class indices, forward and backward, decided for ``rows``' size
    class. Timed on at most :data:`CALIBRATION_LOGITS` logits: the per-row times, scaled to the
    size class (PyTorch's two ATen nodes' fixed cost is not scaled)."""
    size = _size_class(rows)
    timed = min(size, max(_MIN_TIMED_ROWS, CALIBRATION_LOGITS // max(classes, 1)))

    def measure() -> tuple[float, float]:
        engine_us, torch_us = measure_cross_entropy(timed, classes)
        scale, fixed = size / timed, 2 * ATEN_NODE_US
        return engine_us * scale, (torch_us - fixed) * scale + fixed

    return _decide(f"cross_entropy({classes})", "Float", size, measure, loss=True)


def aten_cross_entropy(loss: onnx.NodeProto) -> tuple[onnx.NodeProto, onnx.TensorProto]:
    """The ATen node PyTorch's cross-entropy runs as, in place of the engine's
    ``SoftmaxCrossEntropyLoss`` node ``loss`` (reduction mean or sum, an ``ignore_index``, no
    weight, a ``log_prob`` output that nothing reads): the node, with ``loss``'s name, inputs
    and loss output, and the initializer of its reduction and ignore index. Its second output
    is each row's logsumexp, not the log-probabilities."""
    reduction = attribute(loss, "reduction", "mean")
    ignore_index = attribute(loss, "ignore_index")
    if reduction not in ("mean", "sum") or ignore_index is None or len(loss.input) != 2:
        raise ValueError(f"{loss.name}: not a mean or sum cross-entropy with an ignore_index")
    code = _MEAN if reduction == "mean" else _SUM
    params = onnx.numpy_helper.from_array(
        np.array([code, int(ignore_index)], np.int64), f"{loss.name}/reduction_and_ignore_index"
    )
    outputs = [loss.output[0], f"{loss.name}/logsumexp", f"{loss.name}/total"]
    node = onnx.helper.make_node(
        "ATen",
        [loss.input[0], loss.input[1], params.name],
        outputs,
        name=loss.name,
        domain=ATEN_DOMAIN,
        operator=CROSS_ENTROPY,
        overload_name="",
    )
    return node, params


def _cross_entropy_symbolic(
    default: Callable[..., Any],
    g: Any,
    logits: Any,
    target: Any,
    weight: Any,
    reduction: Any,
    ignore_index: Any,
    label_smoothing: Any,
) -> Any:
    args = (logits, target, weight, reduction, ignore_index, label_smoothing)
    mode = sh._maybe_get_const(reduction, "i")
    ignored = sh._maybe_get_const(ignore_index, "i")
    smoothing = sh._maybe_get_const(label_smoothing, "f")
    traced = _traced(g)
    if (
        _dtype(logits) != "Float"
        or not sh._is_none(weight)
        or mode not in (_MEAN, _SUM)
        or not isinstance(ignored, int)
        or smoothing != 0.0
        or traced is None
        or not traced.input_needs_grad
        # label sparsity would shrink this loss to its labelled rows: the engine's node stays
        or traced.label_density is None
        or traced.label_density < DENSITY_THRESHOLD
        or len(traced.sizes) < 2
        or traced.sizes[0] is None
        or len(traced.sizes[0]) != 2
        or traced.sizes[1] is None
        or len(traced.sizes[1]) != 1
    ):
        return default(g, *args)
    rows, classes = traced.sizes[0]
    if cross_entropy_route(rows, classes) != "torch":
        return default(g, *args)
    loss, lse, total = g.op(
        f"{ATEN_DOMAIN}::ATen",
        logits,
        target,
        _ints_const(g, [mode, ignored]),
        operator_s=CROSS_ENTROPY,
        overload_name_s="",
        outputs=3,
    )
    loss.setType(logits.type().with_sizes([]))
    lse.setType(logits.type().with_sizes([None]))
    total.setType(logits.type().with_sizes([]))
    return loss


register_kernel_choice(
    CoveredOperator(
        "aten::cross_entropy_loss",
        _cross_entropy_symbolic,
        lambda: losses.cross_entropy_loss,
    )
)


def _cross_entropy_fx(node: torch.fx.Node) -> AtenChoice | None:
    """The torch_export side of :func:`_cross_entropy_symbolic`. The label density is the
    example batch's, read where the labels are an example input or a view of one (else
    unknown, and the engine's node stays)."""
    logits, target = fx_arg(node, 0, "self"), fx_arg(node, 1, "target")
    weight, mode = fx_arg(node, 2, "weight"), fx_arg(node, 3, "reduction", _MEAN)
    ignored, smoothing = (
        fx_arg(node, 4, "ignore_index", -100),
        fx_arg(node, 5, "label_smoothing", 0.0),
    )
    sizes, label_sizes = fx_sizes(logits), fx_sizes(target)
    if (
        not fx_float32(logits)
        or weight is not None
        or mode not in (_MEAN, _SUM)
        or not isinstance(ignored, int)
        or smoothing != 0.0
        or not fx_needs_grad(logits)
        or sizes is None
        or len(sizes) != 2
        or label_sizes is None
        or len(label_sizes) != 1
    ):
        return None
    density = fx_label_density(target, ignored)
    # label sparsity would shrink this loss to its labelled rows: the engine's node stays
    if density is None or density < DENSITY_THRESHOLD:
        return None
    rows, classes = sizes
    if cross_entropy_route(rows, classes) != "torch":
        return None
    return AtenChoice(
        CROSS_ENTROPY,
        "",
        (logits, target, np.array([mode, ignored], np.int64)),
        extra_outputs=((torch.float32, 1), (torch.float32, 0)),
    )


register_fx_kernel_choice([torch.ops.aten.cross_entropy_loss.default], _cross_entropy_fx)
