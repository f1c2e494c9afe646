"""``detach()`` and ``torch.no_grad()`` inside a forward on the ``torch_export`` frontend: the
gradient is cut where eager's is.

torch.export keeps both in its training graph, as an ``aten.detach`` node and as a
``wrap_with_set_grad_enabled(False, body, ...)`` higher-order node; the translator's
decompositions then drop them (``detach`` is an alias to ONNX, the body is inlined), and the
engine differentiated through both: a silently wrong gradient (a ``Linear`` whose output is
also read under ``no_grad`` got twice eager's weight gradient).

:func:`cut_detached_gradients` does on the FX graph what the TorchScript frontend's
:func:`~ortmodule_exporter.export.gradient_cuts.cut_gradients` does on the trace: it works out
which values require grad as eager's autograd does (an op other than ``detach``, outside a
no-grad body, requires grad when an input does), and routes each read of a value that does not
require grad but was computed from a trainable input, by an op whose result does, through
``ortmodule::stop_gradient``. That operator stays whole through the decompositions, and
``torch_export_fixes`` turns its node into the copy the TorchScript frontend writes, one the
engine never differentiates.

A no-grad body's output that is one of its operands handed back (``h.float()`` of a float32
``h`` under ``no_grad``: eager returns ``h`` itself, which still requires grad) requires grad as
that operand does; later reads of ``h`` read that output.

>>> from ortmodule_exporter.export.torch_export_grad_cuts import cut_detached_gradients
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from .gradient_cuts import DETACHING_OPERATORS, VALUE_FREE_OPERATORS

__all__ = ["cut_detached_gradients"]


def _stop_gradient() -> Any:
    return torch.ops.ortmodule.stop_gradient.default


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    values = val if isinstance(val, (list, tuple)) else [val]
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point for v in values)


def _name(target: Any) -> str:
    schema = getattr(target, "_schema", None)
    return str(schema.name) if schema is not None else ""


def _trainable_placeholders(
    program: torch.export.ExportedProgram, tensors: Sequence[torch.Tensor]
) -> set[str]:
    """The placeholder names of the parameters that require grad and of the user inputs that
    do (``tensors``, the example inputs, in the program's user-input order)."""
    from torch.export.graph_signature import InputKind  # noqa: PLC0415 - torch.export's own

    found: set[str] = set()
    user = iter(tensors)
    state = program.state_dict
    for spec in program.graph_signature.input_specs:
        name = getattr(spec.arg, "name", None)
        if spec.kind == InputKind.USER_INPUT:
            example = next(user, None)
            if name is not None and isinstance(example, torch.Tensor) and example.requires_grad:
                found.add(name)
        elif spec.kind == InputKind.PARAMETER and name is not None:
            parameter = state.get(spec.target) if spec.target is not None else None
            if isinstance(parameter, torch.Tensor) and parameter.requires_grad:
                found.add(name)
    return found


# ops that return their input tensor itself when they have nothing to do (``h.to(h.dtype)``,
# ``h.float()`` of a float32 ``h``, ``h.contiguous()`` of a contiguous one, ``h.type_as(h)``)
_SELF_RETURNING = frozenset({"aten::to", "aten::contiguous", "aten::type_as"})


def _argument(node: torch.fx.Node, name: str) -> Any:
    """The value ``node`` passed for its operator's argument ``name``, by position or keyword."""
    schema = getattr(node.target, "_schema", None)
    for position, argument in enumerate(schema.arguments if schema is not None else ()):
        if argument.name == name:
            if position < len(node.args):
                return node.args[position]
            return node.kwargs.get(
                name, argument.default_value if argument.has_default_value() else None
            )
    return node.kwargs.get(name)


def _same_tensor_layout(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and (a.dtype, a.device, tuple(a.shape), a.stride())
        == (b.dtype, b.device, tuple(b.shape), b.stride())
    )


def _returned_operand(module: torch.fx.GraphModule, item: torch.fx.Node) -> torch.fx.Node | None:
    """For ``item = wrap_with_set_grad_enabled(False, body, *operands)[i]``: the operand that
    output ``i`` of ``body`` is, handed back as is or through ops that returned their input
    itself; None otherwise. In eager that output *is* the operand's tensor, and still requires
    grad when the operand does, though the body ran under no_grad."""
    wrap, index = item.args
    if (
        not isinstance(wrap, torch.fx.Node)
        or wrap.target is not torch.ops.higher_order.wrap_with_set_grad_enabled
        or wrap.args[0]
        or not isinstance(wrap.args[1], torch.fx.Node)
        or not isinstance(index, int)
    ):
        return None
    body = getattr(module, str(wrap.args[1].target), None)
    if not isinstance(body, torch.fx.GraphModule):
        return None
    outputs = body.graph.output_node().args[0]
    value = outputs[index] if isinstance(outputs, (list, tuple)) and index < len(outputs) else None
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        source = value.args[0] if value.args else None
        if (
            _name(value.target) not in _SELF_RETURNING
            or _argument(value, "copy")
            or not isinstance(source, torch.fx.Node)
            or not _same_tensor_layout(source.meta.get("val"), value.meta.get("val"))
        ):
            return None
        value = source
    if not isinstance(value, torch.fx.Node) or value.op != "placeholder":
        return None
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    operands = wrap.args[2:]
    position = placeholders.index(value)
    operand = operands[position] if position < len(operands) else None
    return operand if isinstance(operand, torch.fx.Node) else None


def cut_detached_gradients(
    program: torch.export.ExportedProgram, tensors: Sequence[torch.Tensor]
) -> int:
    """Insert ``ortmodule::stop_gradient`` on each read, by an op whose result requires grad,
    of a value that does not require grad (a ``detach``, a no-grad body's output) but depends
    on a trainable input; in place. Returns the number of values cut."""
    graph = program.graph_module.graph
    placeholders = _trainable_placeholders(program, tensors)
    trainable: set[torch.fx.Node] = {
        n for n in graph.nodes if n.op == "placeholder" and n.name in placeholders
    }
    requires_grad = set(trainable)
    cuts: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        inputs = [i for i in node.all_input_nodes if i.op != "get_attr"]
        reads_trainable = any(i in trainable for i in inputs)
        if node.target is operator.getitem:
            # an output of a multi-output node: as the node is; a no-grad body's output that is
            # one of its operands handed back, as the operand is
            if inputs and inputs[0] in requires_grad:
                requires_grad.add(node)
            operand = _returned_operand(program.graph_module, node)
            if operand is not None and operand in requires_grad:
                requires_grad.add(node)
            if reads_trainable:
                trainable.add(node)
            continue
        no_grad_body = (
            node.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not node.args[0]
        )
        outputs_grad = (
            not no_grad_body
            and _name(node.target) not in DETACHING_OPERATORS
            and any(i in requires_grad for i in inputs)
            and _is_float(node)
        )
        if outputs_grad:
            requires_grad.add(node)
            for source in inputs:
                if source not in trainable or source in requires_grad or not _is_float(source):
                    continue
                cut = cuts.get(source)
                if cut is None:
                    with graph.inserting_after(source):
                        cut = graph.call_function(_stop_gradient(), (source,))
                    cut.meta["val"] = source.meta.get("val")
                    cuts[source] = cut
                node.replace_input_with(source, cut)
        if reads_trainable and _name(node.target) not in VALUE_FREE_OPERATORS:
            trainable.add(node)
    if cuts:
        program.graph_module.recompile()
    return len(cuts)
