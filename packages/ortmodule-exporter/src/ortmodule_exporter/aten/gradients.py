"""Gradients of ATen nodes: which backward operator the engine builds for each forward one.

The engine differentiates an ``org.pytorch.aten::ATen`` node only through a gradient definition
registered under ``org.pytorch.aten::ATen::<operator>::<overload_name>``: a short list of nodes
that read the forward node's inputs ``I(i)``, outputs ``O(i)`` and output gradients ``GO(i)``
and produce the input gradients ``GI(i)``.

>>> from ortmodule_exporter.aten.gradients import GradientNode, register_aten_gradient
>>> register_aten_gradient("my_op", "", [
...     GradientNode.aten("my_op_backward", ["GO(0)", "I(0)"], ["GI(0)"]),
... ])

The engine builds a definition's ``GI(i)`` outputs as they are written, so a definition fits
operators whose differentiable inputs always need their gradient (a weight, attention's q/k/v).
Operators without one are trained through a PythonOp instead
(:func:`ortmodule_exporter.passes.aten_nodes.prepare_aten_nodes`), whose backward the engine
shapes per node.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine_binding import _C
from .executor import ATEN_DOMAIN

__all__ = [
    "GradientNode",
    "gradient_key",
    "has_gradient",
    "install_gradients",
    "register_aten_gradient",
    "register_stop_gradient_edges",
    "registered_gradients",
    "stop_gradient_edges",
]

logger = logging.getLogger("ortmodule.exporter")


@dataclass(frozen=True)
class GradientNode:
    """One node of a gradient definition. ``attributes``: name -> (value, dtype[, is_tensor]),
    dtype being ``int``, ``float``, ``string``, ``bool``, ``IElemType(i)`` or ``OElemType(i)``."""

    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    domain: str = ""
    attributes: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)

    @classmethod
    def aten(
        cls, operator: str, inputs: Sequence[str], outputs: Sequence[str], overload: str = ""
    ) -> GradientNode:
        attrs: dict[str, tuple[Any, ...]] = {"operator": (operator, "string")}
        if overload:
            attrs["overload_name"] = (overload, "string")
        return cls("ATen", tuple(inputs), tuple(outputs), ATEN_DOMAIN, attrs)

    @classmethod
    def onnx(
        cls,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str],
        **attributes: tuple[Any, ...],
    ) -> GradientNode:
        return cls(op_type, tuple(inputs), tuple(outputs), "", attributes)


def gradient_key(operator: str, overload: str = "") -> str:
    """The engine's registry key of an ATen node's gradient."""
    return f"{ATEN_DOMAIN}::ATen::{operator}::{overload}"


_LOCK = threading.RLock()
_GRADIENTS: dict[str, tuple[GradientNode, ...]] = {}
_STOP_EDGES: dict[str, frozenset[int]] = {}
_SENT: set[str] = set()
_INSTALLED = [False]


def register_aten_gradient(operator: str, overload: str, nodes: Sequence[GradientNode]) -> None:
    """The backward of ATen nodes ``operator.overload`` is ``nodes`` (sent to the engine at once
    when it is installed, else on :func:`install_gradients`). A key is sent once per process:
    the engine keeps the first definition it gets."""
    key = gradient_key(operator, overload)
    with _LOCK:
        if key in _SENT:
            if _GRADIENTS.get(key) != tuple(nodes):
                logger.warning(
                    "gradient of %s was already given to the engine; the new one is ignored", key
                )
            return
        _GRADIENTS[key] = tuple(nodes)
        if _INSTALLED[0]:
            _send(key)


def register_stop_gradient_edges(operator: str, overload: str, inputs: Sequence[int]) -> None:
    """Inputs of ``operator.overload`` the engine must not differentiate (indices, flags, ...)."""
    key = gradient_key(operator, overload)
    with _LOCK:
        _STOP_EDGES[key] = frozenset(inputs)
        if _INSTALLED[0]:
            _send_stop_edges(key)


def stop_gradient_edges(operator: str, overload: str = "") -> frozenset[int]:
    """The inputs of ``operator.overload`` registered as never differentiated."""
    with _LOCK:
        return _STOP_EDGES.get(gradient_key(operator, overload), frozenset())


def has_gradient(operator: str, overload: str = "") -> bool:
    with _LOCK:
        return gradient_key(operator, overload) in _GRADIENTS


def registered_gradients() -> dict[str, tuple[GradientNode, ...]]:
    with _LOCK:
        return dict(_GRADIENTS)


def _definition(nodes: Sequence[GradientNode]) -> list[Any]:

    C = _C()
    result = []
    for node in nodes:
        d = C.GradientNodeDefinition()
        d.op_type = node.op_type
        d.domain = node.domain
        d.inputs = list(node.inputs)
        d.outputs = list(node.outputs)
        attrs = []
        for name, spec in node.attributes.items():
            a = C.GradientNodeAttributeDefinition()
            a.name = name
            a.value_json = json.dumps(spec[0])
            a.dtype = spec[1]
            a.is_tensor = bool(spec[2]) if len(spec) > 2 else False
            attrs.append(a)
        d.attributes = attrs
        result.append(d)
    return result


def _send(key: str) -> None:

    _C().register_gradient_definition(key, _definition(_GRADIENTS[key]))
    _SENT.add(key)


def _send_stop_edges(key: str) -> None:

    _C().register_custom_stop_gradient_edges(key, set(_STOP_EDGES[key]))


def install_gradients() -> None:
    """Give the engine every registered gradient (idempotent); later ones go as registered."""
    with _LOCK:
        _INSTALLED[0] = True
        for key in list(_GRADIENTS):
            if key not in _SENT:
                _send(key)
        for key in _STOP_EDGES:
            _send_stop_edges(key)


# -- explicit backward operators ----------------------------------------------------------------


def _refs(kind: str, *indices: int) -> list[str]:
    """Gradient-definition references: ``_refs("I", 0, 1)`` is ``["I(0)", "I(1)"]``."""
    return [f"{kind}({i})" for i in indices]


def _register_builtin_gradients() -> None:
    # embedding: PyTorch's embedding_backward honours padding_idx (no gradient for that row) and
    # scale_grad_by_freq, which the ONNX Gather gradient cannot.
    register_aten_gradient(
        "embedding",
        "",
        [
            GradientNode.onnx("Shape", ["I(0)"], ["Shape_W"]),
            GradientNode.onnx("Constant", [], ["Zero"], value=(0, "int", True)),
            GradientNode.onnx("Gather", ["Shape_W", "Zero"], ["Num_W"], axis=(0, "int")),
            GradientNode.aten(
                "embedding_backward",
                [*_refs("GO", 0), "I(1)", "Num_W", *_refs("I", 2, 3, 4)],
                _refs("GI", 0),
            ),
        ],
    )
    register_stop_gradient_edges("embedding", "", [1, 2, 3, 4])
    # dropout with eager's masks (ORTMODULE_ATEN_DROPOUT): the forward's mask, scaled by
    # 1 / (1 - p), p being the node's float input (float32 from the TorchScript route, float64
    # from the torch_export one, which writes a schema's float as a double)
    register_aten_gradient(
        "native_dropout",
        "",
        [
            GradientNode.onnx("Constant", [], ["One"], value=(1.0, "float", True)),
            GradientNode.onnx("Cast", ["I(1)"], ["P"], to=(1, "int")),
            GradientNode.onnx("Sub", ["One", "P"], ["Keep"]),
            GradientNode.onnx("Reciprocal", ["Keep"], ["Scale"]),
            GradientNode.aten(
                "native_dropout_backward", [*_refs("GO", 0), "O(1)", "Scale"], _refs("GI", 0)
            ),
        ],
    )
    register_stop_gradient_edges("native_dropout", "", [1, 2])
    # PyTorch's CPU flash attention and its backward (ORTMODULE_ATEN_SDPA_FALLBACK)
    register_aten_gradient(
        "_scaled_dot_product_flash_attention_for_cpu",
        "",
        [
            GradientNode.aten(
                "_scaled_dot_product_flash_attention_for_cpu_backward",
                # grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, ...
                [*_refs("GO", 0), *_refs("I", 0, 1, 2), *_refs("O", 0, 1), *_refs("I", 3, 4, 5, 6)],
                _refs("GI", 0, 1, 2),
            )
        ],
    )
    register_stop_gradient_edges("_scaled_dot_product_flash_attention_for_cpu", "", [3, 4, 5, 6])
    # memory-efficient attention on CUDA; the mask (attn_bias) gets no gradient
    register_aten_gradient(
        "_scaled_dot_product_efficient_attention",
        "",
        [
            GradientNode.onnx("Constant", [], ["Grad_Mask"], value=([1, 1, 1, 0], "int", True)),
            GradientNode.aten(
                "_scaled_dot_product_efficient_attention_backward",
                # grad_out, query, key, value, attn_bias, the four forward outputs, dropout_p,
                # which of the four gradients to compute, is_causal, scale
                [
                    *_refs("GO", 0),
                    *_refs("I", 0, 1, 2, 3),
                    *_refs("O", 0, 1, 2, 3),
                    *_refs("I", 5),
                    "Grad_Mask",
                    *_refs("I", 6, 7),
                ],
                [*_refs("GI", 0, 1, 2), ""],
            ),
        ],
    )
    register_stop_gradient_edges("_scaled_dot_product_efficient_attention", "", [3, 4, 5, 6, 7])


_register_builtin_gradients()
