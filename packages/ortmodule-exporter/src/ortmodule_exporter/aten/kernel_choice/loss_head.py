"""The loss's gradient and the output head's two gradient products in one node, a block of
classes at a time (written by the built-graph pass ``passes/loss_head_grads.py``).

Where the cross-entropy and the products run on PyTorch, a causal LM's backward starts with
``_ortmodule_cross_entropy_backward`` writing the logits' gradient ``G`` (rows x classes: 206 MB
at GPT-2 124M, batch 4 x 256, 50257 classes), then two ``_ortmodule_matmul`` nodes read it: the
hidden states' gradient ``G @ W`` and the head weight's ``G^T @ X``. ``G`` is alive while the
weight's gradient (154 MB) is written: the step's peak. Here the classes are taken a block at a
time (:data:`_BLOCK_ELEMENTS` of ``G``, 16 MiB): the block of ``G`` (the same elementwise
operations as the cross-entropy's backward, in the same order), the weight gradient's rows of
those classes (``G_b^T @ X``, each row a sum over the same rows as the whole product's), and
the block's share of ``G @ W`` added to the hidden states' gradient. ``G`` never exists whole.

The weight gradient's rows are the whole product's (each is its own dot products over the same
rows); the hidden states' gradient sums the classes' shares block after block, so it equals the
whole product up to float rounding (1e-10 against values of 1e-4 at GPT-2's size). With the
engine's threads the classes are cut into one range per piece (``parallel.run_pieces``), each
piece sums its own share, and the shares are added in piece order: a fixed count of pieces gives
the same bits every step.

Inputs: the cross-entropy backward's own (six, or eight for :data:`ADDS_OUTPUT_GRAD`), then the
head's weight ``W`` (classes x hidden), the rows ``X`` (rows x hidden) and the shape the graph
gave ``G`` before ``G @ W`` (an ONNX ``Reshape`` target). Outputs: ``G @ W`` in that shape with
``hidden`` last, and ``G^T @ X``. Overload ``"<cross-entropy overload>|<flags>"``: each flag
``o`` (that output is a graph output's: not pooled) or ``-``. Inputs of other shapes than these
(none the pass writes) are computed the unfused way.

>>> loss_head_overload("", False, True)
'|-o'
"""

from __future__ import annotations

import functools

import onnx
import torch

from .. import output_pool, parallel
from ..executor import AtenFunction, register_aten_function
from .cross_entropy import (
    _MEAN,
    ADDS_OUTPUT_GRAD,
    _cross_entropy_backward,
    _onnx_shape,
    _picked,
    cross_entropy_backward_overload,
)
from .helpers import _all_tensors, _aten_overload

#: the fused node's ATen operator name
LOSS_HEAD_BACKWARD = "_ortmodule_loss_head_backward"

#: elements of the logits' gradient one block of classes holds (16 MiB of float32: 4096 classes
#: of 1024 rows)
_BLOCK_ELEMENTS = 1 << 22


def loss_head_overload(loss_overload: str, hidden_output: bool, weight_output: bool) -> str:
    """The overload name of a :data:`LOSS_HEAD_BACKWARD` node."""
    return f"{loss_overload}|{'o' if hidden_output else '-'}{'o' if weight_output else '-'}"


def parse_loss_head_overload(overload: str) -> tuple[str, bool, bool]:
    """``(loss overload, hidden gradient is a graph output, weight gradient is)``."""
    loss, flags = overload.rsplit("|", 1)
    return loss, flags[0] == "o", flags[1] == "o"


def adds_output_grad(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a loss gradient that adds an outside gradient
    (``passes/output_grad_sums.py``), alone or fused with the head's products."""
    fused = _aten_overload(node, LOSS_HEAD_BACKWARD)
    if fused is not None:
        return parse_loss_head_overload(fused)[0] == ADDS_OUTPUT_GRAD
    return cross_entropy_backward_overload(node) == ADDS_OUTPUT_GRAD


def _loss_head_backward(
    overload: str, inputs: list[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    loss_overload, hidden_output, weight_output = parse_loss_head_overload(overload)
    *loss_inputs, weight, x, shape = inputs
    assert weight is not None and x is not None and shape is not None
    outside: torch.Tensor | None = None
    outside_shape: torch.Tensor | None = None
    if loss_overload == ADDS_OUTPUT_GRAD:
        *core, outside, outside_shape = loss_inputs
    else:
        core = loss_inputs
    grad, logits, lse, target, total, params = core
    assert grad is not None and logits is not None and lse is not None
    assert target is not None and total is not None and params is not None
    if (
        logits.dim() != 2
        or logits.device.type != "cpu"
        or weight.dim() != 2
        or x.shape != (logits.shape[0], weight.shape[1])
        or weight.shape[0] != logits.shape[1]
    ):
        return _unfused(loss_overload, loss_inputs, weight, x, shape)
    rows, classes = logits.shape
    hidden = weight.shape[1]
    reduction, ignore_index = params.tolist()
    kept, picked = _picked(target, ignore_index)
    scale = grad / total if reduction == _MEAN else grad
    row = torch.where(kept, scale, 0).unsqueeze(1)
    picked = picked.squeeze(1)
    gshape = _onnx_shape(logits, shape)
    extra: torch.Tensor | None = None
    if outside is not None and (outside.numel() != 1 or bool(outside.reshape(()) != 0)):
        assert outside_shape is not None
        extra = torch.broadcast_to(outside, _onnx_shape(logits, outside_shape)).reshape(
            rows, classes
        )
    weight_grad = output_pool.empty_output(
        [classes, hidden], logits.dtype, logits.device, weight_output
    )
    block = max(1, min(classes, _BLOCK_ELEMENTS // max(rows, 1)))
    pieces = max(1, min(parallel.width(), -(-classes // block)))
    bounds = [(classes * i // pieces, classes * (i + 1) // pieces) for i in range(pieces)]
    # each piece's share of G @ W; the first is the output, which the others are added to
    hidden_grad = output_pool.empty_output(
        [rows, hidden], logits.dtype, logits.device, hidden_output
    )
    shares = [hidden_grad.zero_(), *(torch.zeros_like(hidden_grad) for _ in bounds[1:])]

    def piece(index: int) -> None:
        start, stop = bounds[index]
        scratch = logits.new_empty((rows, min(block, stop - start)))
        share = shares[index]
        for a in range(start, stop, block):
            b = min(a + block, stop)
            g = scratch[:, : b - a]
            # the cross-entropy's backward on these classes: softmax times the row's scale,
            # minus the scale at the row's class, plus the outside gradient
            torch.sub(logits[:, a:b], lse.unsqueeze(1), out=g).exp_().mul_(row)
            hit = ((picked >= a) & (picked < b)).nonzero().squeeze(1)
            if hit.numel():
                g[hit, picked[hit] - a] -= row[hit, 0]
            if extra is not None:
                g.add_(extra[:, a:b])
            torch.mm(g.t(), x, out=weight_grad[a:b])
            share.addmm_(g, weight[a:b])

    jobs = [functools.partial(piece, i) for i in range(pieces)]
    if pieces < 2 or parallel.run_pieces(jobs) is None:
        for i in range(pieces):
            piece(i)
    for share in shares[1:]:
        hidden_grad.add_(share)
    return [hidden_grad.view(*gshape[:-1], hidden), weight_grad]


def _unfused(
    loss_overload: str,
    loss_inputs: list[torch.Tensor | None],
    weight: torch.Tensor,
    x: torch.Tensor,
    shape: torch.Tensor,
) -> list[torch.Tensor | None]:
    """The three nodes the fused one replaced, one after the other."""
    (g,) = _cross_entropy_backward(loss_overload, list(loss_inputs))
    assert g is not None
    hidden_grad = g.view(_onnx_shape(g, shape)) @ weight
    weight_grad = g.reshape(x.shape[0], -1).t() @ x
    return [hidden_grad, weight_grad]


register_aten_function(LOSS_HEAD_BACKWARD, AtenFunction(_loss_head_backward, _all_tensors))
