"""What a leaf is: a tensor, a constant that lives in the schema, a container, or unsupported."""

from __future__ import annotations

from collections.abc import Hashable
from enum import Enum
from typing import Any, Final

import torch

from ortmodule_pytree.containers import handler_for

__all__ = [
    "CONSTANT",
    "CONTAINER",
    "SUPPORTED_LEAVES",
    "TENSOR",
    "UNSUPPORTED",
    "constant_key",
    "leaf_kind",
]

TENSOR: Final = 0
CONSTANT: Final = 1
CONTAINER: Final = 2
UNSUPPORTED: Final = 3

SUPPORTED_LEAVES: Final = (
    "Tensor, None, bool, int, float, complex, str, bytes, torch.dtype, torch.device, Enum members"
)

_CONSTANT_TYPES: Final = (bool, int, float, complex, str, bytes, Enum)

# Tensor and constant kinds never change, so they are cached by type; container-ness depends on
# the registry and is cached there.
KIND_CACHE: dict[type, int] = {
    torch.Tensor: TENSOR,
    torch.nn.Parameter: TENSOR,
    type(None): CONSTANT,
    bool: CONSTANT,
    int: CONSTANT,
    float: CONSTANT,
    complex: CONSTANT,
    str: CONSTANT,
    bytes: CONSTANT,
    torch.dtype: CONSTANT,
    torch.device: CONSTANT,
}


def leaf_kind(cls: type) -> int:
    """TENSOR, CONSTANT, CONTAINER or UNSUPPORTED for a leaf of type ``cls``."""
    kind = KIND_CACHE.get(cls)
    if kind is not None:
        return kind
    if issubclass(cls, torch.Tensor):
        kind = TENSOR
    elif issubclass(cls, _CONSTANT_TYPES):
        kind = CONSTANT
    else:
        return CONTAINER if handler_for(cls) is not None else UNSUPPORTED
    KIND_CACHE[cls] = kind
    return kind


def constant_key(value: Any) -> Hashable:
    """What decides whether two constants are the same schema-wise.

    Tagged with the type so ``True``, ``1`` and ``1.0`` differ; floats by ``repr`` so a NaN flag
    equals itself and ``-0.0`` differs from ``0.0``.
    """
    cls = type(value)
    if issubclass(cls, (float, complex)):
        return (cls, repr(value))
    return (cls, value)
