"""The fuzz IR's pieces: dims, shapes, named tensors and ops (see :mod:`.program`).

Shapes are tuples of dims; a dim is an ``int`` or a symbol (``"B"``, ``"T"``) whose value may
change from step to step (:attr:`Program.sizes`). Ops read symbolic sizes from the traced
tensors (``x.shape[0]``), never as constants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Dim = int | str
Shape = tuple[Dim, ...]


@dataclass(frozen=True)
class Tensor:
    """A named input or parameter: its shape and how it is made."""

    name: str
    shape: Shape
    #: inputs: whether the input requires grad; parameters: the init ("randn" or "one")
    kind: str = "randn"


@dataclass(frozen=True)
class Op:
    """One statement of ``forward``: ``out = <kind>(args, attrs)``, of shape ``shape``."""

    out: str
    kind: str
    args: tuple[str, ...]
    attrs: tuple[tuple[str, Any], ...] = ()
    shape: Shape = ()

    def attr(self, key: str) -> Any:
        return dict(self.attrs)[key]
