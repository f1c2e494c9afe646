"""Python numbers where an ATen operator takes a Tensor, in the torch.export graph, as 0-d
tensors.

``torch.add(0.3333, mask, alpha=0.6667)`` (Hugging Face's PhiMoE router) runs in eager with the
number wrapped as a tensor; torch.export records ``aten.add.Tensor(0.3333, mask, alpha=...)``
with the bare number in the ``Tensor self`` slot. The dynamo translator's type-promotion pass
(``InsertTypePromotion``, before any of our code sees a node) re-runs such a node once its
tensor argument needs a cast (``mask`` is bool) and finds no overload for a float ``self``:
the whole translation fails. As ``aten.scalar_tensor`` of the dtype PyTorch gives a wrapped
number (the default float dtype, int64, bool), 0-d, the promotion is the same: a 0-d tensor,
like a wrapped number, does not decide the result's dtype within its category against a
tensor with dims.

>>> from ortmodule_exporter.export.torch_export_numbers import numbers_as_tensors
"""

from __future__ import annotations

from typing import Any

import torch


def _dtype(value: bool | int | float) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()


def _fake_mode(graph: torch.fx.Graph) -> Any:
    values = [n.meta.get("val") for n in graph.nodes if n.op == "placeholder"]
    return torch._guards.detect_fake_mode(values)


def numbers_as_tensors(program: torch.export.ExportedProgram) -> int:
    """Give every ATen node's Tensor argument that is a Python number an ``aten.scalar_tensor``
    node instead (in place); returns how many."""
    count = 0
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        fake_mode = None
        changed = False
        for node in list(graph.nodes):
            target = node.target
            if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
                continue
            args = list(node.args)
            kwargs = dict(node.kwargs)
            for index, argument in enumerate(target._schema.arguments):
                if not isinstance(argument.type, torch.TensorType):
                    continue
                positional = not argument.kwarg_only and index < len(args)
                value = args[index] if positional else kwargs.get(argument.name)
                if not isinstance(value, (bool, int, float)):
                    continue
                dtype = _dtype(value)
                with graph.inserting_before(node):
                    made = graph.call_function(
                        torch.ops.aten.scalar_tensor.default, (value,), {"dtype": dtype}
                    )
                for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                    if key in node.meta:
                        made.meta[key] = node.meta[key]
                if fake_mode is None:
                    fake_mode = _fake_mode(graph)
                if fake_mode is not None:
                    with fake_mode:
                        made.meta["val"] = torch.scalar_tensor(value, dtype=dtype)
                if positional:
                    args[index] = made
                else:
                    kwargs[argument.name] = made
                count += 1
                changed = True
            node.args = tuple(args)
            node.kwargs = kwargs
        if changed and isinstance(module, torch.fx.GraphModule):
            module.recompile()
    return count
