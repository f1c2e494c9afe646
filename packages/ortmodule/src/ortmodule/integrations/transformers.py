"""Hugging Face ``transformers`` support: cache objects in inputs and outputs.

Decoder models return ``past_key_values`` as a ``transformers.cache_utils.Cache`` (a
``DynamicCache`` even in training, an ``EncoderDecoderCache`` for T5 and BART). Their tensors
are graph outputs like any other: this module teaches ``ortmodule_pytree`` to take every
``Cache`` and every cache layer apart into its tensors and to build an equivalent object around
the engine's tensors, so gradients flow through them when the user uses them.

It is imported only when ``transformers`` already is (see :mod:`ortmodule.integrations`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Any

import torch

import ortmodule_pytree

__all__ = ["install"]

_lock = threading.Lock()
_done = False


def install() -> None:
    """Register the ``transformers.cache_utils`` families with ``ortmodule_pytree`` (once)."""
    global _done
    with _lock:
        if _done:
            return
        from transformers import cache_utils

        bases = [
            getattr(cache_utils, name)
            for name in ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin")
            if hasattr(cache_utils, name)
        ]
        for base in bases:
            ortmodule_pytree.register_container(
                base, _flatten_state, _unflatten_state, subclasses=True
            )
        _STATE_BASES.extend(bases)
        _done = True


_STATE_BASES: list[type] = []


def _is_structure(value: Any) -> bool:
    """Values that become children (flattened further); the rest is static context."""
    return isinstance(value, (torch.Tensor, list, tuple, dict)) or isinstance(
        value, tuple(_STATE_BASES)
    )


def _flatten_state(obj: Any) -> tuple[dict[str, Any], Hashable]:
    # A cache is a plain Python object: its tensors and nested layers are children, its flags,
    # dtype, device and layer classes are the context (so a change in them is a schema change).
    children: dict[str, Any] = {}
    static: list[tuple[str, Any]] = []
    for name, value in vars(obj).items():
        if _is_structure(value):
            children[name] = value
            continue
        try:
            hash(value)
        except TypeError:
            raise TypeError(
                f"ORTModule cannot pass {type(obj).__qualname__}.{name} (a "
                f"{type(value).__qualname__}) through the engine: it is neither a tensor nor a "
                "hashable constant. Call the model with use_cache=False, or register the cache "
                "class with ortmodule_pytree.register_container."
            ) from None
        static.append((name, value))
    return children, (type(obj), tuple(static))


def _unflatten_state(children: dict[str, Any], context: Any) -> Any:
    # Rebuilt without calling the constructor: the constructors of the cache classes take
    # configs and allocate, while the state is all there is to a cache.
    cls, static = context
    obj = cls.__new__(cls)
    obj.__dict__.update(static)
    obj.__dict__.update(children)
    return obj
