"""A minimal look-alike of Hugging Face's ``transformers.utils.ModelOutput``.

Many real models return one of these: an ``OrderedDict`` subclass decorated with ``@dataclass``,
where fields that are ``None`` are absent from the mapping, ``out.loss`` and ``out["loss"]`` read
the same value, and ``out[0]`` is the first field that is not ``None``. ORTModule has to hand the
same type back, so the zoo uses this to check it without depending on transformers.

    @dataclass
    class MyOutput(ModelOutput):
        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None

    out = MyOutput(logits=torch.ones(2))
    list(out.keys())  # ['logits']
    out[0] is out.logits is out["logits"]  # True
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

__all__ = ["ModelOutput"]


class ModelOutput(OrderedDict[str, Any]):
    """Base for ``@dataclass`` outputs; every field must default to ``None``."""

    def __post_init__(self) -> None:
        # The dataclass __init__ set the attributes before the mapping existed; mirror the ones
        # that are not None into it, in field order (that order is what ``to_tuple`` gives).
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if value is not None:
                super().__setitem__(field.name, value)

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def to_tuple(self) -> tuple[Any, ...]:
        """The values that are not ``None``, in field order."""
        return tuple(self.values())
