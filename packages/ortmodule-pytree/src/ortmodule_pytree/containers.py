"""Containers that torch's pytree registry does not know, handled without touching that registry.

torch's pytree handles list, tuple, dict, namedtuple, OrderedDict, defaultdict, deque and any
type someone registered with it (Hugging Face registers its ``ModelOutput`` classes, for
example). Everything else it treats as a leaf. This module adds, privately:

- dataclasses (rebuilt with ``cls(**fields)``),
- mapping/dataclass hybrids such as ``ModelOutput`` look-alikes: an ``OrderedDict`` subclass
  decorated as a dataclass, flattened by its mapping so fields that are ``None`` (and therefore
  absent from the mapping) stay absent on the way back,
- subclasses of list, tuple and dict (rebuilt with ``cls(items)``),
- user types passed to :func:`register_container`.

How: when a flatten meets one of these as a leaf, it wraps it in :class:`ContainerNode` and
flattens again. ``ContainerNode`` is the only type this package registers with torch's pytree;
its unflatten function builds the user's object directly, so the ``TreeSpec`` torch produces
rebuilds the original types, and user dataclasses never enter torch's global registry (where they
would change what ``torch.export`` and ``torch.compile`` do with them, or make a later
``register_pytree_node`` call of the user's fail).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping
from enum import Enum
from typing import Any, Final, TypeVar

import torch

from ortmodule_pytree._torch_pytree import (
    SUPPORTED_NODES,
    GetAttrKey,
    KeyEntry,
    MappingKey,
    SequenceKey,
    is_namedtuple_class,
    register_pytree_node,
)

__all__ = [
    "ContainerHandler",
    "ContainerNode",
    "UserHandler",
    "handler_for",
    "register_container",
    "unregister_container",
    "wrap_container",
]

T = TypeVar("T")

# A node's context is always a tuple whose first item is the container's class.
Context = tuple[Any, ...]


class ContainerHandler:
    """How one family of containers flattens and rebuilds."""

    def flatten(self, obj: Any) -> tuple[list[Any], Context]:
        raise NotImplementedError

    def unflatten(self, children: list[Any], context: Context) -> Any:
        raise NotImplementedError

    def keys(self, context: Context, num_children: int) -> list[KeyEntry]:
        """One key per child, in the style of torch's key paths (``[0]``, ``['k']``, ``.attr``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"

    def __reduce__(self) -> str | tuple[Any, ...]:
        # Schemas compare handlers by identity, so unpickling must give the same objects back:
        # the module-level singletons by name.
        for name in ("DATACLASS", "MAPPING_DATACLASS", "SEQUENCE_SUBCLASS", "DICT_SUBCLASS"):
            if globals().get(name) is self:
                return name
        raise TypeError(f"{self!r} cannot be pickled")


_init_fields_cache: dict[type, tuple[str, ...]] = {}


def _init_fields(cls: type) -> tuple[str, ...]:
    names = _init_fields_cache.get(cls)
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(cls) if f.init)
        _init_fields_cache[cls] = names
    return names


class _DataclassHandler(ContainerHandler):
    # Only ``init`` fields: they are what the constructor takes; the others are derived in
    # ``__post_init__`` and get derived again on the way back.
    def flatten(self, obj: Any) -> tuple[list[Any], Context]:
        cls = type(obj)
        names = _init_fields(cls)
        return [getattr(obj, name) for name in names], (cls, names)

    def unflatten(self, children: list[Any], context: Context) -> Any:
        cls, names = context
        return cls(**dict(zip(names, children, strict=True)))

    def keys(self, context: Context, num_children: int) -> list[KeyEntry]:
        return [GetAttrKey(name) for name in context[1]]


class _MappingDataclassHandler(ContainerHandler):
    # ModelOutput-style: the mapping holds only the fields that are not None, and the
    # constructor puts exactly those back, so flattening the mapping round-trips.
    def flatten(self, obj: Any) -> tuple[list[Any], Context]:
        return list(obj.values()), (type(obj), tuple(obj.keys()))

    def unflatten(self, children: list[Any], context: Context) -> Any:
        cls, keys = context
        fields = _init_fields(cls)
        obj = cls(**{k: v for k, v in zip(keys, children, strict=True) if k in fields})
        for key, value in zip(keys, children, strict=True):
            if key not in fields:  # set on the mapping after construction
                obj[key] = value
        return obj

    def keys(self, context: Context, num_children: int) -> list[KeyEntry]:
        return [MappingKey(key) for key in context[1]]


class _SequenceSubclassHandler(ContainerHandler):
    def flatten(self, obj: Any) -> tuple[list[Any], Context]:
        return list(obj), (type(obj),)

    def unflatten(self, children: list[Any], context: Context) -> Any:
        return context[0](children)

    def keys(self, context: Context, num_children: int) -> list[KeyEntry]:
        return [SequenceKey(i) for i in range(num_children)]


class _DictSubclassHandler(ContainerHandler):
    def flatten(self, obj: Any) -> tuple[list[Any], Context]:
        keys = tuple(obj.keys())
        factory = obj.default_factory if isinstance(obj, defaultdict) else None
        return list(obj.values()), (type(obj), keys, factory)

    def unflatten(self, children: list[Any], context: Context) -> Any:
        cls, keys, factory = context
        items = zip(keys, children, strict=True)
        if issubclass(cls, defaultdict):
            return cls(factory, items)
        return cls(items)

    def keys(self, context: Context, num_children: int) -> list[KeyEntry]:
        return [MappingKey(key) for key in context[1]]


class UserHandler(ContainerHandler):
    def __init__(
        self,
        cls: type,
        flatten_fn: Callable[[Any], tuple[Any, Hashable]],
        unflatten_fn: Callable[[Any, Any], Any],
    ) -> None:
        self.cls = cls
        self.flatten_fn = flatten_fn
        self.unflatten_fn = unflatten_fn

    def flatten(self, obj: Any) -> tuple[list[Any], Context]:
        result = self.flatten_fn(obj)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"the flatten_fn registered for {_qualname(self.cls)} returned "
                f"{type(result).__name__}; it must return (children, context) where children "
                "is a list or a dict with str keys"
            )
        children, context = result
        if isinstance(children, dict):
            names = tuple(children)
            if not all(isinstance(name, str) for name in names):
                raise TypeError(
                    f"the flatten_fn registered for {_qualname(self.cls)} returned a dict of "
                    "children with non-str keys; use str keys (attribute-like names) or a list"
                )
            return list(children.values()), (self.cls, context, names)
        if isinstance(children, (list, tuple)):
            return list(children), (self.cls, context, None)
        raise TypeError(
            f"the flatten_fn registered for {_qualname(self.cls)} returned children of type "
            f"{type(children).__name__}; it must be a list or a dict with str keys"
        )

    def unflatten(self, children: list[Any], context: Context) -> Any:
        _, user_context, names = context
        if names is None:
            return self.unflatten_fn(children, user_context)
        return self.unflatten_fn(dict(zip(names, children, strict=True)), user_context)

    def keys(self, context: Context, num_children: int) -> list[KeyEntry]:
        names = context[2]
        if names is None:
            return [SequenceKey(i) for i in range(num_children)]
        return [GetAttrKey(name) for name in names]

    def __repr__(self) -> str:
        return f"<container {_qualname(self.cls)}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # The registration of the process that unpickles, looked up by class.
        return (_registered_handler, (self.cls,))


def _registered_handler(cls: type) -> ContainerHandler:
    handler = _registry.get(cls)
    if handler is None:
        raise KeyError(
            f"{_qualname(cls)} is not registered with ortmodule_pytree in this process; "
            "call register_container before loading a schema that uses it"
        )
    return handler


DATACLASS: Final = _DataclassHandler()
MAPPING_DATACLASS: Final = _MappingDataclassHandler()
SEQUENCE_SUBCLASS: Final = _SequenceSubclassHandler()
DICT_SUBCLASS: Final = _DictSubclassHandler()


class ContainerNode:
    """Private pytree node standing in for a container torch's registry does not know."""

    __slots__ = ("handler", "obj")

    def __init__(self, handler: ContainerHandler, obj: Any) -> None:
        self.handler = handler
        self.obj = obj


def _node_flatten(node: ContainerNode) -> tuple[list[Any], tuple[ContainerHandler, Context]]:
    children, context = node.handler.flatten(node.obj)
    # Wrapping the children here resolves nested dataclasses in the same pass.
    return [wrap_container(child) for child in children], (node.handler, context)


def _node_unflatten(values: Any, context: tuple[ContainerHandler, Context]) -> Any:
    handler, inner = context
    return handler.unflatten(list(values), inner)


def _node_flatten_with_keys(
    node: ContainerNode,
) -> tuple[list[tuple[KeyEntry, Any]], tuple[ContainerHandler, Context]]:
    children, context = _node_flatten(node)
    keys = context[0].keys(context[1], len(children))
    return list(zip(keys, children, strict=True)), context


if ContainerNode not in SUPPORTED_NODES:
    register_pytree_node(
        ContainerNode,
        _node_flatten,
        _node_unflatten,
        serialized_type_name=f"{__name__}.ContainerNode",
        flatten_with_keys_fn=_node_flatten_with_keys,
    )


_registry: dict[type, ContainerHandler] = {}
# Registrations that also cover subclasses (``register_container(..., subclasses=True)``).
_family_registry: dict[type, ContainerHandler] = {}
_registry_lock = threading.Lock()
_MISSING: Final = object()
_handler_cache: dict[type, ContainerHandler | None] = {}

# Leaf types that can never be containers.
_SCALAR_TYPES: Final = (torch.Tensor, Enum, bool, int, float, complex, str, bytes)


def _find_handler(cls: type) -> ContainerHandler | None:
    user = _registry.get(cls)
    if user is not None:
        return user
    if _family_registry:
        for base in cls.__mro__:
            family = _family_registry.get(base)
            if family is not None:
                return family
    if cls in SUPPORTED_NODES or is_namedtuple_class(cls) or issubclass(cls, _SCALAR_TYPES):
        return None  # torch's pytree handles it, or it is a leaf
    if dataclasses.is_dataclass(cls):
        return MAPPING_DATACLASS if issubclass(cls, Mapping) else DATACLASS
    if issubclass(cls, (list, tuple)):
        return SEQUENCE_SUBCLASS
    if issubclass(cls, dict):
        return DICT_SUBCLASS
    return None


def handler_for(cls: type) -> ContainerHandler | None:
    """The private handler for ``cls``, or None when torch's pytree handles it or it is a leaf."""
    handler = _handler_cache.get(cls, _MISSING)
    if handler is _MISSING:
        handler = _find_handler(cls)
        _handler_cache[cls] = handler
    if handler is not None and cls in SUPPORTED_NODES:
        return None  # registered with torch after we first saw it: torch's registration wins
    return handler  # type: ignore[return-value]


def wrap_container(value: Any) -> Any:
    """``value`` wrapped in a :class:`ContainerNode` if it is a private container, else itself."""
    handler = handler_for(type(value))
    return value if handler is None else ContainerNode(handler, value)


def register_container(
    cls: type[T],
    flatten_fn: Callable[[T], tuple[list[Any] | dict[str, Any], Hashable]],
    unflatten_fn: Callable[[Any, Any], T],
    *,
    subclasses: bool = False,
) -> None:
    """Teach flatten and unflatten a container type of your own.

    ``flatten_fn(obj)`` returns ``(children, context)``: ``children`` is either a list
    (positional: names ``input.0``, paths ``input[0]``) or a dict with str keys (named: names
    ``input.weight``, paths ``input.weight``); ``context`` is anything hashable and comparable
    that ``unflatten_fn`` needs besides the children. It is part of the schema, so a change in
    it is a schema change. ``unflatten_fn(children, context)`` gets the children back in the
    same form (list or dict, same order) and returns the object. Matching is by exact type,
    or with ``subclasses=True`` also every subclass of ``cls`` (an exact registration of a
    subclass wins; ``flatten_fn`` then gets the subclass instance, so put ``type(obj)`` into the
    context when ``unflatten_fn`` must rebuild the same class).

    >>> class Pair:
    ...     def __init__(self, left, right):
    ...         self.left, self.right = left, right
    >>> register_container(
    ...     Pair,
    ...     lambda p: ({"left": p.left, "right": p.right}, None),
    ...     lambda children, _: Pair(**children),
    ... )

    Also works for dataclass-like types whose default handling (``cls(**init_fields)``) does not
    fit. Types that torch's pytree already handles cannot be registered here.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_container needs a class, got {cls!r}")
    if not callable(flatten_fn) or not callable(unflatten_fn):
        raise TypeError("register_container needs callable flatten_fn and unflatten_fn")
    if issubclass(cls, _SCALAR_TYPES) or cls is type(None):
        raise ValueError(f"{_qualname(cls)} is a leaf type and cannot be registered as a container")
    if cls in SUPPORTED_NODES or is_namedtuple_class(cls):
        raise ValueError(
            f"{_qualname(cls)} is already handled by torch.utils._pytree, whose registration "
            "ortmodule_pytree uses as is"
        )
    with _registry_lock:
        if cls in _registry:
            raise ValueError(
                f"{_qualname(cls)} is already registered; call "
                "ortmodule_pytree.unregister_container first to replace it"
            )
        handler = UserHandler(cls, flatten_fn, unflatten_fn)
        _registry[cls] = handler
        if subclasses:
            _family_registry[cls] = handler
        _handler_cache.clear()


def unregister_container(cls: type) -> None:
    """Undo :func:`register_container` for ``cls``; a KeyError if it was not registered."""
    with _registry_lock:
        if cls not in _registry:
            raise KeyError(f"{_qualname(cls)} is not registered with ortmodule_pytree")
        del _registry[cls]
        _family_registry.pop(cls, None)
        _handler_cache.clear()


def _qualname(cls: type) -> str:
    return getattr(cls, "__qualname__", None) or repr(cls)
