"""Names and paths for leaves, derived from a TreeSpec once per schema.

Two renderings of the same key path:

- the *name*, dot-joined and sanitized, unique within a schema, usable as an ONNX input or
  output name: ``input.1.attention_mask``;
- the *access path*, in Python-access form for messages: ``input[1]['attention_mask']``.
"""

from __future__ import annotations

import re
from collections import OrderedDict, defaultdict, deque
from typing import Any

from ortmodule_pytree._torch_pytree import (
    NAMEDTUPLE_NODE,
    SUPPORTED_NODES,
    GetAttrKey,
    KeyEntry,
    KeyPath,
    MappingKey,
    SequenceKey,
    TreeSpec,
    children,
)
from ortmodule_pytree.containers import ContainerHandler, ContainerNode

__all__ = ["access_path", "child_keys", "leaf_key_paths", "node_type_name", "unique_names"]

_INVALID = re.compile(r"[^0-9A-Za-z_]")


def child_keys(spec: TreeSpec) -> list[KeyEntry]:
    """One key per child of the (non-leaf) node ``spec``, read from its type and context."""
    node_type, context, n = spec.type, spec.context, spec.num_children
    if node_type is ContainerNode:
        handler: ContainerHandler = context[0]
        return handler.keys(context[1], n)
    if node_type in (tuple, list, deque):
        return [SequenceKey(i) for i in range(n)]
    if node_type is dict or node_type is OrderedDict:
        return [MappingKey(k) for k in context]
    if node_type is defaultdict:
        return [MappingKey(k) for k in context[1]]
    if node_type is NAMEDTUPLE_NODE:
        return [GetAttrKey(f) for f in context._fields]
    return _registered_child_keys(spec)


def _registered_child_keys(spec: TreeSpec) -> list[KeyEntry]:
    # A type someone else registered with torch: ask its flatten_with_keys_fn, on a stand-in
    # rebuilt with placeholder leaves since the spec holds no object.
    n = spec.num_children
    node = SUPPORTED_NODES.get(spec.type)
    keys_fn = getattr(node, "flatten_with_keys_fn", None)
    if keys_fn is not None:
        try:
            pairs, _ = keys_fn(spec.unflatten(list(range(spec.num_leaves))))
            keys = [key for key, _ in pairs]
        except Exception:  # the stand-in may not survive the type's constructor
            keys = []
        if len(keys) == n:
            return keys
    context = spec.context
    # Registrations without keys, such as Hugging Face's ModelOutput, keep the field names
    # as their context.
    if isinstance(context, (list, tuple)) and len(context) == n:
        if all(isinstance(k, str) for k in context):
            return [MappingKey(k) for k in context]
    return [SequenceKey(i) for i in range(n)]


def leaf_key_paths(spec: TreeSpec) -> list[KeyPath]:
    """The key path of every leaf of ``spec``, in flatten order."""
    paths: list[KeyPath] = []
    stack: list[tuple[TreeSpec, KeyPath]] = [(spec, ())]
    while stack:
        node, path = stack.pop()
        if node.is_leaf():
            paths.append(path)
            continue
        keys = child_keys(node)
        stack.extend(
            (child, (*path, key))
            for key, child in reversed(list(zip(keys, children(node), strict=True)))
        )
    return paths


def access_path(prefix: str, path: KeyPath) -> str:
    """``input[1]['mask'].foo``: how a user would reach the leaf in Python."""
    return prefix + "".join(str(key) for key in path)


def _segment(key: KeyEntry) -> str:
    if isinstance(key, SequenceKey):
        raw = str(key.idx)
    elif isinstance(key, MappingKey):
        raw = key.key if isinstance(key.key, str) else str(key.key)
    elif isinstance(key, GetAttrKey):
        raw = key.name
    else:
        raw = str(key)
    return _INVALID.sub("_", raw) or "_"


def unique_names(prefix: str, paths: list[KeyPath]) -> list[str]:
    """Dot-joined sanitized names, made unique deterministically.

    Sanitizing can merge names (keys ``"a b"`` and ``"a_b"``); the first in flatten order keeps
    the name, later ones get the smallest ``_<n>`` suffix that is not taken.
    """
    head = _INVALID.sub("_", prefix) or "_"
    names = [".".join((head, *(_segment(key) for key in path))) for path in paths]
    taken = set(names)
    if len(taken) == len(names):
        return names
    seen: set[str] = set()
    unique: list[str] = []
    for name in names:
        if name in seen:
            n = 1
            while f"{name}_{n}" in taken:
                n += 1
            name = f"{name}_{n}"
            taken.add(name)
        seen.add(name)
        unique.append(name)
    return unique


def node_type_name(spec: TreeSpec, *, qualified: bool = False) -> str:
    """The user-facing type name of a non-leaf node: ``dict``, ``MyTuple``, ``CausalLMOutput``."""
    context: Any = spec.context
    if spec.type is ContainerNode:
        cls = context[1][0]
    elif spec.type is NAMEDTUPLE_NODE:
        cls = context
    else:
        cls = spec.type
    name = str(getattr(cls, "__qualname__", None) or repr(cls))
    module = getattr(cls, "__module__", None)
    return f"{module}.{name}" if qualified and module else name
