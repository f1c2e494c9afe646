"""Loss symbolics: ``cross_entropy_loss`` and the ``nll_loss`` family, as the engine's differentiable
``SoftmaxCrossEntropyLoss`` / ``NegativeLogLikelihoodLoss``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh
from .helpers import (
    _TORCH_TYPE,
    Value,
    _cast,
    _const,
    _dim,
    _float_type,
    _rank,
    _reduce,
    _squeeze,
    _unsqueeze,
)

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
