"""Why two schemas differ, in one short line for the re-export log."""

from __future__ import annotations

from typing import Any

import torch

from ortmodule_pytree._torch_pytree import (
    GetAttrKey,
    KeyPath,
    MappingKey,
    SequenceKey,
    TreeSpec,
    children,
)
from ortmodule_pytree.containers import ContainerNode, UserHandler
from ortmodule_pytree.leaves import constant_key
from ortmodule_pytree.naming import access_path, child_keys, node_type_name
from ortmodule_pytree.schema import Schema, TensorMeta, describe_tensor, show_shape

__all__ = ["describe_difference"]

_TENSOR_FIELDS = ("dtype", "rank", "device", "requires_grad", "shape")


def describe_difference(old: Schema, new: Schema) -> str:
    """A short reason why ``new`` differs from ``old``; ``""`` when they are equal.

    >>> describe_difference(old, new)
    "input 'input.mask' dtype changed torch.float32 -> torch.bool"
    """
    if old == new:
        return ""
    if old.prefix != new.prefix:
        return f"prefix changed {old.prefix!r} -> {new.prefix!r}"
    if old.static_shapes != new.static_shapes:
        return f"static_shapes changed {old.static_shapes} -> {new.static_shapes}"
    kind = new.prefix
    count = ""
    if old.num_tensors != new.num_tensors:
        count = f"number of {kind} tensors changed {old.num_tensors} -> {new.num_tensors}"
    if old.treespec != new.treespec:
        reason = f"structure changed at {_structure_difference(old, new)}"
        return f"{reason}; {count}" if count else reason

    reasons: list[str] = []
    names = new._all_names()
    for name, (old_is_tensor, a), (new_is_tensor, b) in zip(
        names, old._leaves(), new._leaves(), strict=True
    ):
        if old_is_tensor and new_is_tensor:
            if a != b:
                reasons.append(f"{kind} '{name}' {_tensor_change(a, b)}")
        elif not old_is_tensor and not new_is_tensor:
            if constant_key(a) != constant_key(b):
                reasons.append(f"{name} changed {a!r} -> {b!r}")
        else:
            change = f"'{name}' was {_leaf(old_is_tensor, a)}, now {_leaf(new_is_tensor, b)}"
            reasons.append(f"{count}: {change}" if count else f"{kind} {change}")
    if not reasons:  # equal leaves and spec, unequal schemas: cannot happen, but say something
        return f"{kind} schema changed"
    more = len(reasons) - 1
    if more:
        return f"{reasons[0]} (and {more} more difference{'s' if more > 1 else ''})"
    return reasons[0]


def _tensor_change(a: TensorMeta, b: TensorMeta) -> str:
    changes = []
    for field, old, new in zip(_TENSOR_FIELDS, a, b, strict=True):
        if old != new:
            changes.append(f"{field} changed {_show(old)} -> {_show(new)}")
    return ", ".join(changes)


def _show(value: object) -> str:
    if isinstance(value, torch.Size):
        return show_shape(value)
    return "dynamic" if value is None else str(value)


def _leaf(is_tensor: bool, value: Any) -> str:
    return describe_tensor(value) if is_tensor else repr(value)


def _structure_difference(old: Schema, new: Schema) -> str:
    """Where the first structural difference is, in Python-access form, and what it is."""
    old_leaves, new_leaves = old._leaves(), new._leaves()
    stack: list[tuple[TreeSpec, TreeSpec, KeyPath, int, int]] = [
        (old.treespec, new.treespec, (), 0, 0)
    ]
    while stack:
        a, b, path, a_offset, b_offset = stack.pop()
        if a.is_leaf() and b.is_leaf():
            continue
        if (
            a.is_leaf()
            or b.is_leaf()
            or a.type != b.type
            or a.num_children != b.num_children
            or a.context != b.context
        ):
            before = _node(a, old_leaves, a_offset)
            after = _node(b, new_leaves, b_offset)
            if before == after:
                before, after = (
                    _node(a, old_leaves, a_offset, True),
                    _node(b, new_leaves, b_offset, True),
                )
            if before == after:  # same type and children: what differs is the context
                before, after = repr(_context(a)), repr(_context(b))
                return f"{access_path(new.prefix, path)}: {node_type_name(a)} context changed {before} -> {after}"
            return f"{access_path(new.prefix, path)}: {before} -> {after}"
        pending = []
        for key, a_child, b_child in zip(child_keys(a), children(a), children(b), strict=True):
            pending.append((a_child, b_child, (*path, key), a_offset, b_offset))
            a_offset += a_child.num_leaves
            b_offset += b_child.num_leaves
        stack.extend(reversed(pending))
    return new.prefix


def _context(spec: TreeSpec) -> Any:
    if spec.type is ContainerNode:
        handler, inner = spec.context
        # A registered container's own context; the rest is ours and follows from the type.
        return inner[1] if isinstance(handler, UserHandler) else inner[1:]
    return spec.context


def _node(
    spec: TreeSpec, leaves: list[tuple[bool, Any]], offset: int, qualified: bool = False
) -> str:
    if spec.is_leaf():
        return _leaf(*leaves[offset])
    name = node_type_name(spec, qualified=qualified)
    keys = child_keys(spec)
    if not keys:
        return f"empty {name}"
    if all(isinstance(k, SequenceKey) for k in keys):
        return f"{name} of length {len(keys)}"
    if all(isinstance(k, MappingKey) for k in keys):
        return f"{name} with keys {[getattr(k, 'key', k) for k in keys]!r}"
    fields = [k.name if isinstance(k, GetAttrKey) else str(k) for k in keys]
    return f"{name}({', '.join(fields)})"
