"""AtenOp: a PyTorch operator without a gradient definition, run by the engine as a PythonOp.

The ATen pass (:mod:`ortmodule_exporter.passes.aten_nodes`) turns such an ATen node into a
PythonOp calling :class:`AtenOp`; its forward runs the operator through the ATen executor with
autograd recording, its backward is autograd's.
"""

from __future__ import annotations

from typing import Any

import torch

from . import executor as aten_executor

__all__ = ["AtenOp"]


def _grouped(inputs: list[Any], groups: str) -> list[Any]:
    """Pack the tensors of list arguments back into lists: ``groups`` is ``"start:count,..."``
    over ``inputs`` (a list argument reaches the PythonOp as its tensors, one input each)."""
    if not groups:
        return inputs
    packed: list[Any] = []
    position = 0
    for group in groups.split(","):
        start, count = (int(v) for v in group.split(":"))
        packed.extend(inputs[position:start])
        packed.append(list(inputs[start : start + count]))
        position = start + count
    packed.extend(inputs[position:])
    return packed


class AtenOp(torch.autograd.Function):
    """A PyTorch operator with no ONNX form, run by the engine as a PythonOp during training.

    ``spec`` is ``"operator|overload[|groups[|count]]"`` (``count``: the operator returns a
    list, of which the node has the first ``count`` elements as outputs). Forward calls the operator (with autograd recording for
    the inputs whose gradient the engine needs); backward is autograd's. The engine's PythonOp
    backward asks, per node, which inputs need a gradient, which a static ATen gradient
    definition cannot (see :mod:`ortmodule_exporter.aten.gradients`).
    """

    @staticmethod
    def forward(ctx: Any, spec: str, *inputs: Any) -> tuple[Any, ...]:
        operator, _, rest = spec.partition("|")
        overload, _, rest = rest.partition("|")
        groups, _, count = rest.partition("|")
        needs = tuple(getattr(ctx, "needs_input_grad", ()))[1:] or (False,) * len(inputs)
        leaves = list(inputs)
        with torch.enable_grad():
            for i, t in enumerate(inputs):
                if needs[i] and isinstance(t, torch.Tensor) and t.is_floating_point():
                    leaves[i] = t.detach().requires_grad_(True)
            try:
                outputs = aten_executor.execute(operator, overload, _grouped(leaves, groups))
            except Exception as err:
                if hasattr(err, "add_note"):
                    err.add_note(f"raised by aten::{operator}.{overload or 'default'}")
                raise
            if count:  # a list of which the graph reads the first ``count`` elements
                outputs = aten_executor.first_elements(operator, outputs, int(count))
        ctx.set_materialize_grads(False)
        ctx.leaves, ctx.results = leaves, outputs
        return tuple(
            _owned(o.detach(), inputs) if isinstance(o, torch.Tensor) else o for o in outputs
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        leaves, results = ctx.leaves, ctx.results
        ctx.leaves = ctx.results = None
        pairs = [
            (o, _to_output_shape(g, o))
            for o, g in zip(results, grads, strict=False)
            if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
        ]
        wanted = [
            i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        gradients: list[Any] = [None] * len(leaves)
        if pairs and wanted:
            computed = torch.autograd.grad(
                [o for o, _ in pairs],
                [leaves[i] for i in wanted],
                [g for _, g in pairs],
                allow_unused=True,
            )
            incoming = [g for _, g in pairs]
            for i, g in zip(wanted, computed, strict=True):
                gradients[i] = _owned(_materialized(g), incoming)
        return (None, *gradients)


def _to_output_shape(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """``grad`` summed to ``output``'s shape where it comes in the shape ``output`` was
    broadcast to. The engine's gradient builder reduces a broadcast operand's gradient only
    where it knows the operand's shape differs; an ATen node's output has dims the export could
    not name, so the builder can take a size-1 dim for the other side's and hand over the
    broadcast gradient (apertus' xIELU parameters of shape (1,): a gradient of shape (128,)).
    Summing over the broadcast dims is the chain rule's reduction; any other mismatch is an
    error that names both shapes."""
    if grad.shape == output.shape:
        return grad
    try:
        broadcast = torch.broadcast_shapes(grad.shape, output.shape)
    except RuntimeError:
        broadcast = None
    if broadcast != grad.shape:
        raise RuntimeError(
            f"the engine handed a gradient of shape {tuple(grad.shape)} for an output of shape "
            f"{tuple(output.shape)} that does not broadcast to it"
        )
    return grad.sum_to_size(output.shape)


def _owned(tensor: torch.Tensor | None, given: Any) -> torch.Tensor | None:
    """``tensor``, copied when it shares memory with one of the tensors ``given`` to the call.

    Autograd hands an incoming gradient straight back as an input's gradient where the
    derivative is 1 (``add``'s, ``to``'s to the same dtype), and an operator may return its input
    (a no-op ``contiguous``). The engine owns each output buffer and frees or reuses its input's
    buffer independently, so an output aliasing an input read freed memory: ``residual + x``
    with a float32 residual and a bfloat16 ``x`` (an AtenOp under autocast) gave gradients
    wrong by 100 % and more (measured 2026-11-26, OPT under bfloat16 autocast)."""
    if tensor is None or tensor.numel() == 0:
        return tensor
    start = tensor.untyped_storage().data_ptr()
    for other in given:
        if (
            isinstance(other, torch.Tensor)
            and other.numel()
            and other.untyped_storage().data_ptr() == start
        ):
            return tensor.clone()
    return tensor


def _materialized(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient the engine can read: autograd may return a ZeroTensor (no storage: sgn's
    gradient) or an empty tensor with any strides, both of which crash a DLPack reader."""
    if grad is None:
        return None
    if grad._is_zerotensor() or grad.numel() == 0:
        return torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
    return grad if grad.is_contiguous() else grad.contiguous()
