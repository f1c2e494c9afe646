"""The kernel choice on the ``torch_export`` frontend: what a family's FX-side decision reads
from a node of the translated ExportedProgram, and the ATen node it asks for.

The TorchScript frontend decides in each family's symbolic, from the sizes the trace recorded
(:mod:`.traced`); the torch_export frontend decides where the dynamo translator lowers each FX
node (``export/torch_export_kernel_choice.py``), from the node's ``meta["val"]``: its sizes are
the example inputs' (the hints of its symbolic dims: the sizes the export ran with, as the
traced ones are), whether a value needs a gradient is the program's (a parameter or input that
requires one, carried through every float operator but ``detach``), and a cross-entropy's label
density is read from the example input its labels are a view of.

Each family registers ``decide(node) -> AtenChoice | None`` for the FX operators it covers
(:func:`register_fx_kernel_choice`); None keeps the translator's lowering (the engine's kernel).

>>> from ortmodule_exporter.aten.kernel_choice import fx_kernel_choice
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...label_density import label_density
from .modes import current_mode, measures

__all__ = [
    "AtenChoice",
    "fx_example_inputs",
    "fx_kernel_choice",
    "register_fx_kernel_choice",
]


@dataclass(frozen=True)
class AtenChoice:
    """The ATen node an FX node becomes where PyTorch's kernel was chosen: the one the family's
    TorchScript symbolic writes (same operator, overload and inputs)."""

    operator: str
    overload: str
    #: one per input: an FX node (its ONNX value), a numpy array (a constant) or None (empty)
    inputs: tuple[Any, ...]
    #: the ATen node's outputs after those the FX node gives, as (dtype, rank): typed so
    extra_outputs: tuple[tuple[torch.dtype, int], ...] = ()
    #: the FX node gives this many outputs as a list (``native_layer_norm``); 0: one value
    listed: int = 0
    #: (indices node, dim): the first output reshaped to the indices' shape + ``[dim]``, which
    #: gives the engine the shape its broadcasting gradients need (an ATen node's output has
    #: none for the engine, see ``embedding.embedding_route``)
    reshape_like: tuple[Any, int] | None = None


_DECIDERS: dict[Any, Callable[[torch.fx.Node], AtenChoice | None]] = {}


def register_fx_kernel_choice(
    targets: Sequence[Any], decide: Callable[[torch.fx.Node], AtenChoice | None]
) -> None:
    """Cover the FX operators ``targets`` (``torch.ops.aten.gelu.default``, ...) on the
    torch_export frontend: ``decide(node)`` is the family's choice for one node.

    >>> register_fx_kernel_choice([torch.ops.aten.gelu.default], _gelu_fx)
    """
    for target in targets:
        _DECIDERS[target] = decide


def fx_covered_operators() -> tuple[str, ...]:
    """The FX operators the kernel choice covers on the torch_export frontend."""
    return tuple(str(t) for t in _DECIDERS)


def fx_kernel_choice(node: torch.fx.Node) -> AtenChoice | None:
    """The ATen node ``node`` becomes under the kernel choice in force, or None (the
    translator's lowering stays)."""
    decide = _DECIDERS.get(node.target)
    mode = current_mode()
    if decide is None or mode == "engine":
        return None
    if measures(mode) and _off_cpu(node):
        # the measurements time CPU kernels (as ``choice._decide`` for a traced export)
        return None
    return decide(node)


def _off_cpu(node: torch.fx.Node) -> bool:
    values = [node.meta.get("val"), *(n.meta.get("val") for n in node.all_input_nodes)]
    return any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in values)


# -- what the deciders read ----------------------------------------------------------------------


def fx_arg(node: torch.fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument ``name`` (position ``index``) of the node's call, or ``default``."""
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def fx_float32(value: Any) -> bool:
    """Whether ``value`` (an FX node) is a float32 tensor."""
    meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(meta, torch.Tensor) and meta.dtype == torch.float32


def fx_sizes(value: Any, symbolic: bool = True) -> tuple[int, ...] | None:
    """An FX node's sizes: a symbolic dim as its hint (the size the example inputs gave it,
    what the TorchScript frontend's trace recorded), or with ``symbolic=False`` unknown (what
    the exported graph knows); None when any is unknown."""
    meta = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    if not isinstance(meta, torch.Tensor):
        return None
    sizes: list[int] = []
    for dim in meta.shape:
        if isinstance(dim, int):
            sizes.append(dim)
        elif symbolic and isinstance(dim, torch.SymInt) and dim.node.hint is not None:
            sizes.append(int(dim.node.hint))
        else:
            return None
    return tuple(sizes)


def fx_ints(value: Any) -> list[int] | None:
    """A list of Python ints (an int is a list of one), else None (a computed size)."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in items] if all(isinstance(v, int) for v in items) else None


#: operators whose result never carries a gradient back to their input
_NO_GRADIENT = frozenset({torch.ops.aten.detach.default})

_NEEDS_GRAD: weakref.WeakKeyDictionary[torch.fx.Graph, frozenset[str]] = weakref.WeakKeyDictionary()


def fx_needs_grad(value: Any) -> bool:
    """Whether an FX node's value needs a gradient: it is computed by float operators from a
    parameter or input that requires one (``detach`` cuts the path)."""
    if not isinstance(value, torch.fx.Node):
        return False
    graph = value.graph
    found = _NEEDS_GRAD.get(graph)
    if found is None:
        found = _NEEDS_GRAD[graph] = _needing_grad(graph)
    return value.name in found


def _floating(meta: Any) -> bool:
    values = meta if isinstance(meta, (list, tuple)) else [meta]
    return any(isinstance(v, torch.Tensor) and v.is_floating_point() for v in values)


def _needing_grad(graph: torch.fx.Graph) -> frozenset[str]:
    names: set[str] = set()
    for node in graph.nodes:
        meta = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(meta, torch.Tensor) and meta.requires_grad:
                names.add(node.name)
        elif (
            node.op == "call_function"
            and node.target not in _NO_GRADIENT
            and _floating(meta)
            and any(i.name in names for i in node.all_input_nodes)
        ):
            names.add(node.name)
    return frozenset(names)


# -- a cross-entropy's labels --------------------------------------------------------------------

_EXAMPLES: contextvars.ContextVar[dict[str, torch.Tensor] | None] = contextvars.ContextVar(
    "ortmodule_fx_example_inputs", default=None
)


@contextlib.contextmanager
def fx_example_inputs(names: Sequence[str], tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """While an ExportedProgram is translated: the example tensors of its user inputs, by
    placeholder name (a cross-entropy's label density is read from them); none where the two
    do not pair up."""
    paired = dict(zip(names, tensors, strict=True)) if len(names) == len(tensors) else None
    token = _EXAMPLES.set(paired)
    try:
        yield
    finally:
        _EXAMPLES.reset(token)


#: operators that only view or copy their input: their result has its elements, in its order
_SAME_ELEMENTS = frozenset(
    {
        torch.ops.aten.view.default,
        torch.ops.aten.reshape.default,
        torch.ops.aten._unsafe_view.default,
        torch.ops.aten.flatten.using_ints,
        torch.ops.aten.clone.default,
        torch.ops.aten.contiguous.default,
        torch.ops.aten.alias.default,
    }
)


def fx_label_density(target: Any, ignore_index: int) -> float | None:
    """The share of counted labels of the example batch, where ``target`` (an FX node) is an
    example input or a view of one; else None (unknown)."""
    examples = _EXAMPLES.get()
    node = target
    while isinstance(node, torch.fx.Node) and node.target in _SAME_ELEMENTS:
        node = node.args[0]
    if examples is None or not isinstance(node, torch.fx.Node) or node.op != "placeholder":
        return None
    labels = examples.get(node.name)
    if labels is None or labels.is_floating_point():
        return None
    return label_density(np.asarray(labels.detach().cpu().numpy()), ignore_index)
