"""Fused CPU attention reads the heads' Transposes away (post-export pass order 35).

Each ``_scaled_dot_product_flash_attention_for_cpu`` ATen node (``ORTMODULE_FUSED_ATTENTION`` or
``ORTMODULE_USE_EFFICIENT_ATTENTION``) whose query, key or value comes from a
``Transpose(perm=[0, 2, 1, 3])``, or whose output goes only to one, becomes an
:data:`~ortmodule_exporter.aten.attention_layout.FLASH_BSHD` node that takes those tensors
untransposed: the copies go, and PyTorch's kernel reads the token-major layout eager gives it
(see :mod:`ortmodule_exporter.aten.attention_layout`). A Transpose left without readers is
removed.

>>> from ortmodule_exporter.passes.attention_layout import read_transposes_into_attention
>>> read_transposes_into_attention(model)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import onnx

from ..aten.attention_layout import FLASH, FLASH_BSHD
from ..aten.executor import ATEN_DOMAIN
from ..onnx_graph import attribute, producers_and_consumers, set_attribute
from .registry import register_post_export_pass

__all__ = ["read_transposes_into_attention"]

logger = logging.getLogger("ortmodule.exporter")

_SWAP = [0, 2, 1, 3]


def _is_swap(node: onnx.NodeProto | None) -> bool:
    return (
        node is not None
        and node.op_type == "Transpose"
        and node.domain in ("", "ai.onnx")
        and list(attribute(node, "perm", []) or []) == _SWAP
    )


def read_transposes_into_attention(model: onnx.ModelProto) -> int:
    """Rewrite the flash-attention nodes as described above; returns how many changed."""
    graph = model.graph
    producers, consumers = producers_and_consumers(graph)
    graph_outputs = {o.name for o in graph.output}
    changed = 0
    dropped: set[int] = set()
    for node in graph.node:
        if (
            node.domain != ATEN_DOMAIN
            or attribute(node, "operator") != FLASH
            or len(node.input) < 3
            or len(node.output) != 2
        ):
            continue
        flags = ""
        inputs = list(node.input)
        for position, flag in enumerate("qkv"):
            source = producers.get(inputs[position])
            if _is_swap(source):
                assert source is not None
                inputs[position] = source.input[0]
                flags += flag
        out = node.output[0]
        readers = consumers.get(out, [])
        output_name = out
        if out not in graph_outputs and len(readers) == 1 and _is_swap(readers[0]):
            output_name = readers[0].output[0]
            dropped.add(id(readers[0]))
            flags += "o"
        if not flags:
            continue
        for position in range(3):
            if inputs[position] != node.input[position]:
                source = producers[node.input[position]]
                readers_of = consumers[source.output[0]]
                readers_of.remove(node)
                if not readers_of and source.output[0] not in graph_outputs:
                    dropped.add(id(source))
        node.input[:] = inputs
        node.output[0] = output_name
        set_attribute(node, "operator", FLASH_BSHD)
        set_attribute(node, "overload_name", flags)
        changed += 1
    if dropped:
        keep = [n for n in graph.node if id(n) not in dropped]
        del graph.node[:]
        graph.node.extend(keep)
    return changed


def _pass(exported: Any, _options: Mapping[str, Any]) -> None:
    n = read_transposes_into_attention(exported.model)
    if n:
        logger.info("attention: %d fused node(s) read their inputs without Transposes", n)


register_post_export_pass("attention_layout", _pass, order=35)
