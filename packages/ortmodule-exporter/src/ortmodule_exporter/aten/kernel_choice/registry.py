"""The table of covered operators: each family registers a :class:`CoveredOperator` (its
symbolic, and the symbolic to fall back to where the engine's kernel stays);
:func:`configure_kernel_choice` installs them all (``auto``, ``torch``) or removes them
(``engine``), in the order they were registered.

>>> from ortmodule_exporter.aten.kernel_choice import configure_kernel_choice, covered_operators
>>> configure_kernel_choice("engine")
>>> covered_operators()[0]
'aten::gelu'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...symbolics.registry import register_symbolic, registered_symbolics, unregister_symbolic
from .modes import _set_mode


@dataclass(frozen=True)
class CoveredOperator:
    """An operator the kernel choice covers: ``symbolic(default, g, *args)`` replaces the
    exporter's symbolic for ``op`` and calls ``default(g, *args)`` (the symbolic it replaced,
    or ``fallback()`` when there was none) where the engine's kernel stays."""

    op: str
    symbolic: Callable[..., Any]
    fallback: Callable[[], Callable[..., Any]]
    opset: int = 9


_COVERED: dict[str, CoveredOperator] = {}
_WRAPPERS: dict[str, Callable[..., Any]] = {}
#: the symbolic each covered operator replaced while ``auto`` or ``torch`` is installed
_PREVIOUS: dict[str, Any] = {}


def register_kernel_choice(entry: CoveredOperator) -> None:
    """Cover ``entry.op``; it is installed by the next :func:`configure_kernel_choice`.

    >>> register_kernel_choice(CoveredOperator("aten::relu", _relu_symbolic, _opset9("relu")))
    """
    op = entry.op

    def wrapper(g: Any, *args: Any) -> Any:
        return entry.symbolic(lambda g, *a: _default(op, g, *a), g, *args)

    wrapper.__qualname__ = f"kernel_choice[{op}]"
    _COVERED[op] = entry
    _WRAPPERS[op] = wrapper


def covered_operators() -> tuple[str, ...]:
    """The symbolics the kernel choice replaces (``aten::gelu``, ...)."""
    return tuple(_COVERED)


def _default(op: str, g: Any, *args: Any) -> Any:
    # the symbolic we replaced, where it applies at this export's opset
    previous = _PREVIOUS.get(op)
    if previous is not None and g.opset >= previous.opset:
        return previous.fn(g, *args)
    return _COVERED[op].fallback()(g, *args)


def _opset9(name: str) -> Callable[[], Callable[..., Any]]:
    def fallback() -> Callable[..., Any]:
        from torch.onnx._internal.torchscript_exporter import symbolic_opset9

        fn: Callable[..., Any] = getattr(symbolic_opset9, name)
        return fn

    return fallback


def configure_kernel_choice(mode: str = "auto", torch_threads: int | None = None) -> None:
    """Install the kernel-choice symbolics (``auto``/``torch``) or remove them (``engine``).

    ``torch_threads``: PyTorch's intra-op threads while the engine runs PyTorch-run nodes
    (``ORTMODULE_TORCH_THREADS_IN_ENGINE``; 0 keeps PyTorch's count), which the measurement
    of the PyTorch side uses; None leaves it as it is."""
    _set_mode(mode, torch_threads)
    symbolics = registered_symbolics()
    for op, wrapper in _WRAPPERS.items():
        current = symbolics.get(op)
        if mode == "engine":
            if current is not None and current.fn is wrapper:
                previous = _PREVIOUS.pop(op, None)
                if previous is not None:
                    register_symbolic(op, previous.fn, previous.opset)
                else:
                    unregister_symbolic(op)
            continue
        if current is not None and current.fn is not wrapper:
            _PREVIOUS[op] = current
        register_symbolic(op, wrapper, _COVERED[op].opset)


def _no_previous(name: str) -> Callable[[], Callable[..., Any]]:
    def fallback() -> Callable[..., Any]:
        raise RuntimeError(f"kernel choice: no symbolic to fall back to for {name}")

    return fallback
