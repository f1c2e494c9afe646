"""How an ``ORTMODULE_*`` variable is declared: its parser, default and documentation.

The runtime declares its own variables with :class:`Option`; a component declares the ones it
acts on in its own package and lists them in its :class:`~ortmodule_exporter.components.Component`
(``options=``). The runtime merges what the installed components declare with its own table, so
parsing, validation, ``DebugOptions`` fields and ``docs/options.md`` need no edit outside the
component:

>>> from ortmodule_exporter.option import Option, int_in, switch
>>> LEVEL = Option("ORTMODULE_MY_LEVEL", "int", 0, int_in(0, 2), "0, 1 or 2", "my-component",
...                "How hard to try.", "1")
>>> LEVEL.convert(" 2 "), switch("ORTMODULE_MY_SWITCH", False, "my-component", "On.").example
(2, '1')

This module imports nothing but the standard library and the exporter's errors, so the
runtime's option table can be read without torch.
"""

from __future__ import annotations

import enum
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import InvalidOptionError

__all__ = [
    "PREFIX",
    "SWITCH",
    "Option",
    "auto_or_count",
    "choice",
    "existing_file",
    "flag_names",
    "flags",
    "folder",
    "format_value",
    "int_in",
    "lower_choice",
    "parse_switch",
    "path",
    "switch",
]

PREFIX = "ORTMODULE_"
#: the accepted values of every switch
SWITCH = "1 or 0 (also true/false, yes/no, on/off)"

_F = TypeVar("_F", bound=enum.IntFlag)


def flag_names(value: enum.IntFlag) -> str:
    """``A|B`` for a combination of flags (``Flag.name`` is None for combinations on Python 3.10)."""
    return "|".join(m.name for m in type(value) if m.name and m in value and m.value) or "0"


def format_value(value: Any) -> str:
    """How a value is written in docs and reports: switches as 1/0, flags as ``A|B``."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, enum.IntFlag):
        return flag_names(value)
    if isinstance(value, enum.Enum):
        return value.name
    return str(value)


# -- parsers: text -> value, raising ValueError with the reason -------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_switch(text: str) -> bool:
    low = text.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError("not a switch")


def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ValueError("not an integer") from None
        if value < lo or (hi is not None and value > hi):
            raise ValueError("out of range")
        return value

    return parse


def auto_or_count(text: str) -> str:
    """``AUTO`` or a thread count >= 0, kept as text (``"AUTO"``, ``"2"``)."""
    if text.upper() == "AUTO":
        return "AUTO"
    return str(int_in(0)(text))


def choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.upper() not in choices:
            raise ValueError("not one of the choices")
        return text.upper()

    return parse


def lower_choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text.lower() not in choices:
            raise ValueError("not one of the choices")
        return text.lower()

    return parse


def flags(kind: type[_F], alone: _F) -> Callable[[str], _F]:
    """``A|B|C`` -> a combination of ``kind``; ``alone`` may not be combined with other flags."""

    def parse(text: str) -> _F:
        names = [part.strip().upper() for part in text.split("|")]
        result = kind(0)
        for name in names:
            member = kind.__members__.get(name)
            if member is None:
                raise ValueError(f"{name or '(empty)'!r} is not a {kind.__name__} flag")
            result |= member
        if alone in result and result != alone:
            raise ValueError(f"{alone.name} cannot be combined with other flags")
        return result

    return parse


def folder(text: str) -> str:
    found = os.path.expanduser(text)
    if os.path.exists(found) and not os.path.isdir(found):
        raise ValueError(f"{found} exists and is not a folder")
    return found


def existing_file(text: str) -> str:
    found = os.path.expanduser(text)
    if not os.path.isfile(found):
        raise ValueError(f"no file at {os.path.abspath(found)}")
    return found


def path(text: str) -> str:
    return os.path.expanduser(text)


# -- the declaration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    """One ``ORTMODULE_*`` variable: how to parse it and how to document it."""

    name: str
    type: str
    default: Any
    parse: Callable[[str], Any]
    accepted: str
    #: the distribution that acts on it (the runtime adds "when installed" for a component's)
    honoured_by: str
    doc: str
    example: str
    #: the ``DebugOptions`` field that sets it from code (the variable, when set, wins)
    debug_field: str | None = None
    #: when the value is truthy, the graph must keep the engine's own nodes (recompute and
    #: Triton work on them): fused attention and PyTorch kernels then step aside by default;
    #: the text names what wants them in the INFO line
    keeps_engine_nodes: str = ""
    #: with ``keeps_engine_nodes``: fused attention may stay (its node keeps only its output and
    #: logsumexp, which nothing needs to recompute); the PyTorch kernels still step aside
    fused_attention_stays: bool = False
    #: ``(variable, why)``: this switch on needs that switch on too
    requires: tuple[str, str] | None = None

    @property
    def field(self) -> str:
        """The :class:`RuntimeOptions` field: the name lower-cased without ``ORTMODULE_``."""
        return self.name[len(PREFIX) :].lower()

    def convert(self, text: str) -> Any:
        """Parse ``text``; an :class:`InvalidOptionError` names the variable, value and choices."""
        try:
            return self.parse(text.strip())
        except ValueError as err:
            raise InvalidOptionError(
                f"{self.name}={text!r} is invalid ({err}); accepted: {self.accepted}. "
                f"For example: export {self.name}={shlex.quote(self.example)}, or unset it for the default "
                f"({format_value(self.default)})."
            ) from None


def switch(name: str, default: bool, honoured_by: str, doc: str, **extra: Any) -> Option:
    """An on/off variable; ``extra`` takes :class:`Option`'s keyword fields."""
    return Option(
        name,
        "bool",
        default,
        parse_switch,
        SWITCH,
        honoured_by,
        doc,
        "0" if default else "1",
        **extra,
    )
