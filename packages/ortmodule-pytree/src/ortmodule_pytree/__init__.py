"""Nested PyTorch inputs and outputs <-> a flat list of tensors plus a hashable schema.

>>> tensors, schema = ortmodule_pytree.flatten(((x,), {"mask": m, "flag": True}))
>>> schema.names
('input.0.0', 'input.1.mask')
>>> ortmodule_pytree.unflatten(tensors, schema)
((x,), {'mask': m, 'flag': True})
"""

from ortmodule_pytree.containers import register_container, unregister_container
from ortmodule_pytree.difference import describe_difference
from ortmodule_pytree.flatten import FlattenMemo, flatten, unflatten
from ortmodule_pytree.schema import Schema, TensorSpec

__version__ = "0.1.0"

__all__ = [
    "FlattenMemo",
    "Schema",
    "TensorSpec",
    "__version__",
    "describe_difference",
    "flatten",
    "register_container",
    "unflatten",
    "unregister_container",
]
