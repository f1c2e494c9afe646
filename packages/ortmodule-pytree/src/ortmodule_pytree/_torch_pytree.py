"""The one place that touches ``torch.utils._pytree``.

torch's pytree module is private; keeping every use of it here makes a change in torch a
one-file fix.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import namedtuple
from typing import Any

import torch.utils._pytree as _pytree
from torch.utils._pytree import (
    SUPPORTED_NODES,
    GetAttrKey,
    KeyEntry,
    MappingKey,
    SequenceKey,
    TreeSpec,
    register_pytree_node,
    tree_flatten,
)

__all__ = [
    "NAMEDTUPLE_NODE",
    "SUPPORTED_NODES",
    "GetAttrKey",
    "KeyEntry",
    "KeyPath",
    "MappingKey",
    "SequenceKey",
    "TreeSpec",
    "children",
    "graft",
    "is_namedtuple_class",
    "register_pytree_node",
    "tree_flatten",
]

KeyPath = tuple[KeyEntry, ...]

# torch files every namedtuple under this one node type; the spec's context is the class.
NAMEDTUPLE_NODE: Any = namedtuple


def children(spec: TreeSpec) -> list[TreeSpec]:
    """The child specs of ``spec`` (``children()`` in recent torch, ``children_specs`` before)."""
    if hasattr(spec, "children"):
        return spec.children()
    return list(spec.children_specs)  # pragma: no cover - torch < 2.6


def is_namedtuple_class(cls: type) -> bool:
    """Whether torch's pytree files ``cls`` under its namedtuple node."""
    check = getattr(_pytree, "is_namedtuple_class", None)
    if check is not None:
        return bool(check(cls))
    fields = getattr(cls, "_fields", None)  # pragma: no cover - torch < 2.6
    return (  # pragma: no cover - torch < 2.6
        issubclass(cls, tuple) and isinstance(fields, tuple) and all(type(f) is str for f in fields)
    )


def graft(spec: TreeSpec, grafts: dict[int, TreeSpec]) -> TreeSpec:
    """``spec`` with the leaf at each index of ``grafts`` replaced by the given subtree spec.

    Only the nodes on the way to a replaced leaf are rebuilt; the rest is shared.
    """
    if not grafts:
        return spec
    targets = sorted(grafts)

    def rebuild(node: TreeSpec, offset: int) -> TreeSpec:
        if node.is_leaf():
            return grafts.get(offset, node)
        first = bisect_left(targets, offset)
        if first == len(targets) or targets[first] >= offset + node.num_leaves:
            return node
        new_children = []
        for child in children(node):
            new_children.append(rebuild(child, offset))
            offset += child.num_leaves
        return TreeSpec(node.type, node.context, new_children)

    return rebuild(spec, 0)
