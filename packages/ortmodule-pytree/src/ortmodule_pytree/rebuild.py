"""Per-schema unflatten, compiled once.

``TreeSpec.unflatten`` walks the spec recursively and slices the leaf list at every node, on every
call; for outputs that is every training step. A schema instead compiles its spec once into one
Python expression that builds the whole structure (``{_k0: (T[0], T[1]), _k1: _c2}``), the way
``dataclasses`` generates ``__init__``. Only identifiers and indices enter the source; keys,
classes, contexts and constants are bound as globals, so no user data is ever parsed as code.
Very deep structures (beyond the parser's nesting limit) fall back to ``TreeSpec.unflatten``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from keyword import iskeyword
from typing import Any

from ortmodule_pytree._torch_pytree import NAMEDTUPLE_NODE, SUPPORTED_NODES, TreeSpec, children
from ortmodule_pytree.containers import DATACLASS, ContainerNode

__all__ = ["Rebuild", "compile_rebuild"]

Rebuild = Callable[[Sequence[Any]], Any]

# Python's parser stops at 200 nested brackets; each level here costs up to two.
_MAX_DEPTH = 64


def compile_rebuild(
    spec: TreeSpec, tensor_positions: Sequence[int], constants: Sequence[Any]
) -> Rebuild:
    """A function ``tensors -> structure``; ``constants`` fill the leaves that are not tensors."""
    is_tensor = [False] * spec.num_leaves
    for position in tensor_positions:
        is_tensor[position] = True
    if _depth(spec) > _MAX_DEPTH:
        return _fallback(spec, is_tensor, constants)

    env: dict[str, Any] = {}

    def bind(value: Any) -> str:
        name = f"_{len(env)}"
        env[name] = value
        return name

    next_tensor = 0
    next_constant = 0
    next_leaf = 0

    def gen(node: TreeSpec) -> str:
        nonlocal next_tensor, next_constant, next_leaf
        if node.is_leaf():
            tensor = is_tensor[next_leaf]
            next_leaf += 1
            if tensor:
                next_tensor += 1
                return f"T[{next_tensor - 1}]"
            next_constant += 1
            return bind(constants[next_constant - 1])
        kids = [gen(child) for child in children(node)]
        node_type, context = node.type, node.context
        if node_type is tuple:
            return "(" + "".join(f"{kid}, " for kid in kids) + ")"
        if node_type is list:
            return "[" + ", ".join(kids) + "]"
        if node_type is dict:
            items = (f"{bind(key)}: {kid}" for key, kid in zip(context, kids, strict=True))
            return "{" + ", ".join(items) + "}"
        if node_type is OrderedDict:
            pairs = "".join(
                f"({bind(key)}, {kid}), " for key, kid in zip(context, kids, strict=True)
            )
            return f"{bind(OrderedDict)}(({pairs}))"
        if node_type is NAMEDTUPLE_NODE:
            return f"{bind(context)}({', '.join(kids)})"
        if node_type is ContainerNode and context[0] is DATACLASS:
            cls, names = context[1]
            if all(name.isidentifier() and not iskeyword(name) for name in names):
                arguments = (f"{name}={kid}" for name, kid in zip(names, kids, strict=True))
                return f"{bind(cls)}({', '.join(arguments)})"
        unflatten_fn = SUPPORTED_NODES[node_type].unflatten_fn
        return f"{bind(unflatten_fn)}([{', '.join(kids)}], {bind(context)})"

    source = f"def rebuild(T):\n    return {gen(spec)}\n"
    exec(compile(source, "<ortmodule_pytree.rebuild>", "exec"), env)
    rebuild: Rebuild = env["rebuild"]
    return rebuild


def _depth(spec: TreeSpec) -> int:
    deepest = 0
    stack = [(spec, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if not node.is_leaf():
            stack.extend((child, depth + 1) for child in children(node))
    return deepest


def _fallback(spec: TreeSpec, is_tensor: list[bool], constants: Sequence[Any]) -> Rebuild:
    template: list[Any] = []
    remaining = iter(constants)
    for tensor in is_tensor:
        template.append(None if tensor else next(remaining))
    positions = [i for i, tensor in enumerate(is_tensor) if tensor]

    def rebuild(tensors: Sequence[Any]) -> Any:
        leaves = list(template)
        for position, tensor in zip(positions, tensors, strict=True):
            leaves[position] = tensor
        return spec.unflatten(leaves)

    return rebuild
