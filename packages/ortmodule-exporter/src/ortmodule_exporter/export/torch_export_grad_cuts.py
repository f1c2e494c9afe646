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
``ortmodule::stop_gradient``. That operator stays whole through the decompositions and takes the
ATen route as a copy whose input the engine never differentiates (its stop-gradient edge is
registered here).

>>> from ortmodule_exporter.export.torch_export_grad_cuts import cut_detached_gradients
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from ..aten.gradients import register_stop_gradient_edges
from .gradient_cuts import DETACHING_OPERATORS, STOP_GRADIENT, VALUE_FREE_OPERATORS

__all__ = ["cut_detached_gradients"]

# the operator the cut inserts (registered by gradient_cuts) runs as an ATen node whose input
# the engine never differentiates
register_stop_gradient_edges(STOP_GRADIENT, "", [0])


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
            # an output of a multi-output node: as the node is
            if inputs and inputs[0] in requires_grad:
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
