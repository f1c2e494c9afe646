"""Schema: everything about a nested structure except its tensors' data (and, by default, shapes).

Two calls with the same schema can run the same exported graph; a different schema means
re-export. A schema holds the torch ``TreeSpec``, each tensor's dtype, rank, device and
requires_grad (and shape with ``static_shapes=True``), and the non-tensor leaves themselves, so a
flag that flips is a schema change. Names, specs, the repr and the compiled unflatten are
computed on first use and kept on the schema.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

import torch

from ortmodule_pytree._torch_pytree import (
    GetAttrKey,
    KeyEntry,
    KeyPath,
    MappingKey,
    TreeSpec,
    children,
)
from ortmodule_pytree.containers import MAPPING_DATACLASS, ContainerNode
from ortmodule_pytree.naming import (
    child_keys,
    leaf_key_paths,
    node_type_name,
    unique_names,
)
from ortmodule_pytree.rebuild import Rebuild, compile_rebuild

__all__ = ["Schema", "TensorMeta", "TensorSpec"]

# (dtype, ndim, device, requires_grad, shape or None): one per tensor, compared as a whole. The
# shape holds -1 for a dynamic dim where only the dims of size 1 count (flatten.shape_pattern).
TensorMeta = tuple[torch.dtype, int, torch.device, bool, torch.Size | None]


# Compiled unflatten functions of the schemas seen lately; cleared when full (a model has a
# handful of schemas, a program that churns through more pays a recompile).
_REBUILDS: dict[Schema, Rebuild] = {}
_MAX_REBUILDS = 256


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSpec:
    """What the schema records about one tensor."""

    name: str
    dtype: torch.dtype
    ndim: int
    device: torch.device
    requires_grad: bool
    shape: tuple[int, ...] | None = None


class Schema:
    """The structure of a flattened object; frozen, hashable, comparable.

    >>> tensors, schema = flatten({"x": torch.ones(2, 3), "flag": True})
    >>> schema.names
    ('input.x',)
    """

    __slots__ = (
        "_spec",
        "prefix",
        "static_shapes",
        "_tensor_positions",
        "_tensor_meta",
        "_constants",
        "_constant_keys",
        "_hash",
        "_paths_cache",
        "_names_cache",
        "_specs_cache",
        "_rebuild_cache",
    )

    _spec: TreeSpec
    #: the first word of every name: ``"input"`` or ``"output"``
    prefix: str
    #: whether tensor shapes are part of this schema
    static_shapes: bool
    _tensor_positions: tuple[int, ...]
    _tensor_meta: tuple[TensorMeta, ...]
    _constants: tuple[Any, ...]
    _constant_keys: tuple[Hashable, ...]
    _hash: int | None
    _paths_cache: list[KeyPath] | None
    _names_cache: list[str] | None
    _specs_cache: tuple[TensorSpec, ...] | None
    _rebuild_cache: Rebuild | None

    def __init__(
        self,
        spec: TreeSpec,
        *,
        prefix: str,
        static_shapes: bool,
        tensor_positions: tuple[int, ...],
        tensor_meta: tuple[TensorMeta, ...],
        constants: tuple[Any, ...],
        constant_keys: tuple[Hashable, ...],
    ) -> None:
        init = object.__setattr__
        init(self, "_spec", spec)
        init(self, "prefix", prefix)
        init(self, "static_shapes", static_shapes)
        init(self, "_tensor_positions", tensor_positions)
        init(self, "_tensor_meta", tensor_meta)
        init(self, "_constants", constants)
        init(self, "_constant_keys", constant_keys)
        init(self, "_hash", None)
        init(self, "_paths_cache", None)
        init(self, "_names_cache", None)
        init(self, "_specs_cache", None)
        init(self, "_rebuild_cache", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Schema is immutable")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickle and deepcopy rebuild through __init__; the caches are recomputed on demand.
        fields = {
            "prefix": self.prefix,
            "static_shapes": self.static_shapes,
            "tensor_positions": self._tensor_positions,
            "tensor_meta": self._tensor_meta,
            "constants": self._constants,
            "constant_keys": self._constant_keys,
        }
        return (_restore, (self._spec, fields))

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Schema is immutable")

    # -- identity ---------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Schema):
            return NotImplemented
        # Cheap tuple comparisons first; the TreeSpec walk only when everything else agrees.
        return (
            self._tensor_meta == other._tensor_meta
            and self._constant_keys == other._constant_keys
            and self._tensor_positions == other._tensor_positions
            and self.prefix == other.prefix
            and self.static_shapes == other.static_shapes
            and self._spec == other._spec
        )

    def __hash__(self) -> int:
        # The spec stays out: hashing it walks the whole tree. Equal schemas still hash equal,
        # structures that differ only in keys or container types merely collide.
        cached = self._hash
        if cached is None:
            cached = hash(
                (
                    self.prefix,
                    self.static_shapes,
                    self._spec.num_nodes,
                    self._tensor_positions,
                    self._tensor_meta,
                    self._constant_keys,
                )
            )
            object.__setattr__(self, "_hash", cached)
        return cached

    def without_shapes(self) -> Schema:
        """This schema with no tensor's shape in it: equal for inputs that differ in shape only."""
        if all(meta[4] is None for meta in self._tensor_meta):
            return self
        restore, (spec, fields) = self.__reduce__()
        fields = dict(fields)
        fields["tensor_meta"] = tuple((*meta[:4], None) for meta in self._tensor_meta)
        shapeless: Schema = restore(spec, fields)
        return shapeless

    # -- public view ------------------------------------------------------------------------

    @property
    def num_tensors(self) -> int:
        return len(self._tensor_positions)

    @property
    def names(self) -> tuple[str, ...]:
        """One unique, ONNX-usable name per tensor, in flatten order: ``input.1.mask``."""
        return tuple(spec.name for spec in self.tensor_specs)

    @property
    def tensor_specs(self) -> tuple[TensorSpec, ...]:
        """Name, dtype, rank, device, requires_grad (and static shape) of each tensor."""
        specs = self._specs_cache
        if specs is None:
            names = self._all_names()
            specs = tuple(
                TensorSpec(
                    name=names[position],
                    dtype=dtype,
                    ndim=ndim,
                    device=device,
                    requires_grad=requires_grad,
                    shape=None if shape is None else tuple(shape),
                )
                for position, (dtype, ndim, device, requires_grad, shape) in zip(
                    self._tensor_positions, self._tensor_meta, strict=True
                )
            )
            object.__setattr__(self, "_specs_cache", specs)
        return specs

    @property
    def treespec(self) -> TreeSpec:
        """torch's ``TreeSpec`` of the structure (private containers appear as ContainerNode)."""
        return self._spec

    # -- helpers for the rest of the package ------------------------------------------------

    def _key_paths(self) -> list[KeyPath]:
        """The key path of every leaf, tensors and constants, in flatten order."""
        paths = self._paths_cache
        if paths is None:
            paths = leaf_key_paths(self._spec)
            object.__setattr__(self, "_paths_cache", paths)
        return paths

    def _all_names(self) -> list[str]:
        """The unique name of every leaf, tensors and constants, in flatten order."""
        names = self._names_cache
        if names is None:
            names = unique_names(self.prefix, self._key_paths())
            object.__setattr__(self, "_names_cache", names)
        return names

    def _leaves(self) -> list[tuple[bool, Any]]:
        """Every leaf in flatten order: ``(True, TensorMeta)`` or ``(False, constant)``."""
        out: list[tuple[bool, Any]] = []
        tensor_meta = iter(self._tensor_meta)
        constants = iter(self._constants)
        positions = set(self._tensor_positions)
        for index in range(self._spec.num_leaves):
            if index in positions:
                out.append((True, next(tensor_meta)))
            else:
                out.append((False, next(constants)))
        return out

    def _rebuild(self, tensors: Sequence[Any]) -> Any:
        """The structure with ``tensors`` in place (see :func:`ortmodule_pytree.unflatten`)."""
        rebuild = self._rebuild_cache
        if rebuild is None:
            # Shared by equal schemas: flatten makes a new schema object on every call.
            rebuild = _REBUILDS.get(self)
            if rebuild is None:
                rebuild = compile_rebuild(self._spec, self._tensor_positions, self._constants)
                if len(_REBUILDS) >= _MAX_REBUILDS:
                    _REBUILDS.clear()
                _REBUILDS[self] = rebuild
            object.__setattr__(self, "_rebuild_cache", rebuild)
        return rebuild(tensors)

    # -- printing ---------------------------------------------------------------------------

    def __repr__(self) -> str:
        rendered = [
            describe_tensor(value) if is_tensor else repr(value)
            for is_tensor, value in self._leaves()
        ]
        return f"Schema({self.prefix}={_render(self._spec, iter(rendered))})"


def _restore(spec: TreeSpec, fields: dict[str, Any]) -> Schema:
    return Schema(spec, **fields)


def show_shape(shape: Sequence[int]) -> str:
    """``(*, 1, 8)``: a shape of the schema, ``*`` for a dynamic dim."""
    dims = ["*" if size == -1 else str(size) for size in shape]
    return f"({dims[0]},)" if len(dims) == 1 else f"({', '.join(dims)})"


def describe_tensor(meta: TensorMeta) -> str:
    """``Tensor(float32, ndim=2, cpu, requires_grad)``."""
    dtype, ndim, device, requires_grad, shape = meta
    parts = [str(dtype).removeprefix("torch.")]
    parts.append(f"ndim={ndim}" if shape is None else f"shape={show_shape(shape)}")
    parts.append(str(device))
    if requires_grad:
        parts.append("requires_grad")
    return f"Tensor({', '.join(parts)})"


def _render(spec: TreeSpec, leaves: Iterator[str]) -> str:
    """The structure in Python-literal style, with ``leaves`` rendered in place."""
    if spec.is_leaf():
        return next(leaves)
    kids = [_render(child, leaves) for child in children(spec)]
    node_type = spec.type
    if node_type is tuple:
        return f"({kids[0]},)" if len(kids) == 1 else f"({', '.join(kids)})"
    if node_type is list:
        return f"[{', '.join(kids)}]"
    keys = child_keys(spec)
    mapping = (
        "{" + ", ".join(f"{_key(k)!r}: {kid}" for k, kid in zip(keys, kids, strict=True)) + "}"
    )
    if node_type is dict:
        return mapping
    name = node_type_name(spec)
    if not keys:
        return f"{name}()"
    model_output = node_type is ContainerNode and spec.context[0] is MAPPING_DATACLASS
    if model_output or all(isinstance(k, GetAttrKey) for k in keys):
        fields = (f"{_key(k)}={kid}" for k, kid in zip(keys, kids, strict=True))
        return f"{name}({', '.join(fields)})"
    if all(isinstance(k, MappingKey) for k in keys):
        return f"{name}({mapping})"
    return f"{name}([{', '.join(kids)}])"


def _key(key: KeyEntry) -> Any:
    if isinstance(key, MappingKey):
        return key.key
    if isinstance(key, GetAttrKey):
        return key.name
    return key
