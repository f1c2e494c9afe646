"""The opt-in ATen routes on the ``torch_export`` frontend: the graph torch.export captured is
rewritten to the operators the TorchScript routes (:mod:`ortmodule_exporter.aten.routes`) write,
before the translation, and those operators are kept whole, so the ATen route
(:mod:`.torch_export_aten`) writes each as the same ``org.pytorch.aten::ATen`` node. The same
executor functions, registered gradients and passes (attention layout, padding elimination)
then take them, whichever frontend wrote the graph.

Under the export config in force (:func:`ortmodule_exporter.aten.routes.aten_routes`, which reads
:func:`ortmodule_exporter.active_export.active_export_config`, else the process defaults):

* ``aten_sdpa_fallback`` / ``efficient_attention``: ``aten.scaled_dot_product_attention`` (as
  torch.export's training IR holds it) becomes ``_scaled_dot_product_flash_attention_for_cpu``
  (a CPU query) or ``_scaled_dot_product_efficient_attention`` (CUDA) with an additive float
  mask, under the TorchScript route's conditions: no dropout, 4-D query and value, no grouped
  heads, a mask without gradient (the fused kernels' backward gives the mask none);
* ``aten_dropout``: training-mode ``aten.dropout`` with 0 < p < 1 becomes ``native_dropout``
  (PyTorch draws the mask from its generator as eager's ``dropout`` does; the gradient reuses
  it). p = 0, p = 1 and eval mode are left to the translation, which draws nothing.

Why rewrite the FX graph rather than the translation's output: the rewritten graph is a
PyTorch program with eager's meaning (its retrace in the translator checks it), and the ATen
route then writes each node from its schema as it writes any operator it keeps whole.

>>> from ortmodule_exporter.export.torch_export_routes import route_program
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch

from ..aten.routes import aten_routes

__all__ = ["FLASH_CPU", "EFFICIENT", "route_program"]

logger = logging.getLogger("ortmodule.exporter")

aten = torch.ops.aten

FLASH_CPU = aten._scaled_dot_product_flash_attention_for_cpu.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
_SDPA = aten.scaled_dot_product_attention.default
_DROPOUT = aten.dropout.default
_DROPOUT_ = aten.dropout_.default
_FEATURE_DROPOUT = aten.feature_dropout.default
_NATIVE_DROPOUT = aten.native_dropout.default


def route_program(program: torch.export.ExportedProgram) -> frozenset[Any]:
    """Rewrite ``program``'s graph (in place) to the routes the export config in force asks
    for; returns the operators written that the translation must keep whole."""
    routes = aten_routes()  # the export config in force, else the process defaults
    sdpa = routes.sdpa_fallback or routes.efficient_attention
    dropout = routes.dropout
    if not (sdpa or dropout):
        return frozenset()
    graph = program.graph_module.graph
    written: set[Any] = set()
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if sdpa and node.target is _SDPA:
            made = _sdpa(graph, node)
        elif dropout and node.target in (_DROPOUT, _DROPOUT_):
            made = _dropout(graph, node)
        elif dropout and node.target is _FEATURE_DROPOUT:
            made = _feature_dropout(graph, node)
        else:
            continue
        if made is not None:
            written.add(made)
    if dropout and any(_attention_dropout(n) for n in graph.nodes):
        # attention with dropout: PyTorch runs every attention left unfused, drawing its mask
        # as eager does (the executor's AtenOp keeps autograd's record, mask included)
        written.add(_SDPA)
    if written:
        graph.lint()
        program.graph_module.recompile()
    return frozenset(written)


def _bound(node: torch.fx.Node) -> dict[str, Any]:
    """``node``'s arguments by schema name, defaults filled in."""
    schema = node.target._schema  # type: ignore[union-attr]
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if not arg.kwarg_only and i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def _val(value: Any) -> Any:
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else None


def _sdpa(graph: torch.fx.Graph, node: torch.fx.Node) -> Any:
    """The TorchScript route's ``_sdpa`` on an FX node: the fused kernel's node, or None."""
    a = _bound(node)
    query, value, mask = _val(a["query"]), _val(a["value"]), a["attn_mask"]
    scale = a["scale"]
    if (
        not isinstance(a["dropout_p"], float)
        or a["dropout_p"] != 0.0
        or not isinstance(a["is_causal"], bool)
        or a["enable_gqa"] is not False
        or not (scale is None or isinstance(scale, float))
        or not isinstance(query, torch.Tensor)
        or not isinstance(value, torch.Tensor)
        or query.dim() != 4
        or value.dim() != 4
    ):
        return None
    mask_val = _val(mask)
    if mask is not None and not isinstance(mask_val, torch.Tensor):
        return None
    if mask_val is not None and _reaches_gradient(mask):
        # the fused kernels' backward gives the mask no gradient: a learned bias stays decomposed
        return None
    with graph.inserting_before(node):
        if mask_val is not None and mask_val.dtype == torch.bool:
            # the fused kernels take an additive float mask
            mask = graph.call_function(aten.where.Scalar, (mask, 0.0, float("-inf")))
            if query.dtype != torch.float32:
                mask = graph.call_function(aten._to_copy.default, (mask,), {"dtype": query.dtype})
        if query.device.type == "cuda":
            target = EFFICIENT
            fused = graph.call_function(
                target,
                (a["query"], a["key"], a["value"], mask, True, 0.0, a["is_causal"]),
                {"scale": scale},
            )
        else:
            target = FLASH_CPU
            fused = graph.call_function(
                target,
                (a["query"], a["key"], a["value"], 0.0, a["is_causal"]),
                {"attn_mask": mask, "scale": scale},
            )
        out = graph.call_function(operator.getitem, (fused, 0))
    _replace(node, out)
    return target


def _reaches_gradient(node: torch.fx.Node) -> bool:
    """Whether a gradient can flow into ``node``: a float path from it back to an input that
    requires grad (the training IR's values carry ``requires_grad`` on its inputs only, parameters
    included)."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        val = _val(current)
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            continue
        if current.op == "placeholder" and val.requires_grad:
            return True
        stack.extend(current.all_input_nodes)
    return False


def _attention_dropout(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _SDPA:
        return False
    rate = _bound(node)["dropout_p"]
    return not isinstance(rate, float) or rate != 0.0


def _rate(node: torch.fx.Node) -> float | None:
    """The dropout rate of a training-mode dropout node that draws (0 < p < 1), else None:
    eager draws nothing for p = 0 nor p = 1, and the translation draws nothing either."""
    a = _bound(node)
    rate, train = a["p"], a["train"]
    if train is not True or not isinstance(rate, float) or not 0.0 < rate < 1.0:
        return None
    return rate


def _dropout(graph: torch.fx.Graph, node: torch.fx.Node) -> Any:
    """Training-mode dropout (0 < p < 1) as ``native_dropout``, or None. The in-place
    ``dropout_`` of a computed tensor too: later readers of that tensor read the result."""
    rate = _rate(node)
    x = node.args[0]
    if rate is None or not isinstance(x, torch.fx.Node):
        return None
    if node.target is _DROPOUT_ and x.op == "placeholder":
        # a write into an input: left to the translation, which keeps the write
        return None
    with graph.inserting_before(node):
        pair = graph.call_function(_NATIVE_DROPOUT, (x, rate, True))
        out = graph.call_function(operator.getitem, (pair, 0))
    if node.target is _DROPOUT_:
        order = {n: i for i, n in enumerate(graph.nodes)}
        x.replace_all_uses_with(out, delete_user_cb=lambda user: order[user] > order[node])
    _replace(node, out)
    return _NATIVE_DROPOUT


def _feature_dropout(graph: torch.fx.Graph, node: torch.fx.Node) -> Any:
    """Training-mode ``feature_dropout`` (``Dropout1d/2d/3d``) as the TorchScript route writes
    it: ``native_dropout`` over ones of shape (N, C, 1, ...), which draws what eager's noise
    tensor of that shape draws, times the input."""
    rate = _rate(node)
    x = node.args[0]
    val = _val(x)
    if rate is None or not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    with graph.inserting_before(node):
        sizes: list[Any] = []
        for axis in (0, 1):
            size = val.shape[axis]
            sizes.append(
                size if isinstance(size, int) else graph.call_function(aten.sym_size.int, (x, axis))
            )
        ones = graph.call_function(aten.new_ones.default, (x, [*sizes, *[1] * (val.dim() - 2)]))
        pair = graph.call_function(_NATIVE_DROPOUT, (ones, rate, True))
        mask = graph.call_function(operator.getitem, (pair, 0))
        out = graph.call_function(aten.mul.Tensor, (x, mask))
    _replace(node, out)
    return _NATIVE_DROPOUT


def _replace(node: torch.fx.Node, out: torch.fx.Node) -> None:
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    if "val" in node.meta:
        out.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(out)
    node.graph.erase_node(node)
