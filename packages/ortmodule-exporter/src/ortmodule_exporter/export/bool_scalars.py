"""Python ``bool`` values given to an operator's ``Scalar`` argument are traced as tensors or
numbers.

The TorchScript tracer of torch 2.13 records such a value as a ``bool`` constant, and no schema
takes ``bool`` for ``Scalar`` (the JIT's ``number`` is int, float or complex). The trace then
fails in its own clean-up, before any symbolic runs, with an internal assert of the alias
analysis ("We don't have an op for aten::scatter but it isn't a special case. Argument types:
Tensor, int, Tensor, bool"). Every such call fails: ``mask.scatter(-1, index, False)`` (the
indexer of DeepSeek-sparse-attention models), ``x.masked_fill(m, True)``, ``b == True``,
``b & True``, ``torch.full(size, False)``, ``torch.where(c, x, False)``.

While the export traces, a ``TorchFunctionMode`` passes such a value differently: as a 0-d bool
tensor where an overload takes a tensor there (``b & torch.tensor(True)`` exports as ONNX
``And``), else as the int 0 or 1. Which one is decided by running the call untraced, once as
eager runs it and once per candidate: the first candidate whose result, cast to eager's dtypes,
equals eager's is traced, and cast to those dtypes (``b & 1`` would be int64 where ``b & True``
is bool; ``torch.full(size, 0)`` is int64). When none does, :class:`ExportError` names the
operator. An in-place call keeps its tensor's dtype, cannot be run twice, and takes the int.

Operators written in Python (``torch.nn.functional``) run their inner calls outside the mode;
a ``bool`` such a function passes on itself still fails the trace as before.

>>> b = torch.rand(3) > 0.5
>>> with bool_scalars_as_numbers():
...     graph, _ = torch.jit._get_trace_graph(lambda b: b.masked_fill(b, False), (b,))
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ExportError

__all__ = ["bool_scalars_as_numbers"]

#: Python's comparison methods of ``Tensor`` and the ATen operators they call
_DUNDERS = {
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
}  # fmt: skip

Key = int | str  # a positional index or a keyword


@contextlib.contextmanager
def bool_scalars_as_numbers() -> Iterator[None]:
    """For one export's trace: pass ``bool`` values of ``Scalar`` arguments as 0-d tensors or
    numbers, which the tracer records as it can."""
    with _BoolScalars():
        yield


class _BoolScalars(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types_: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch._C._get_tracing_state() is None or not _has_bool(args, kwargs):
            return func(*args, **kwargs)
        schemas = _schemas(func)
        tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        keys: list[Key] = [
            *(i for i, a in enumerate(args) if type(a) is bool),
            *(k for k, v in kwargs.items() if type(v) is bool),
        ]
        keys = [k for k in keys if _takes(schemas, tensors, k, torch._C.NumberType)]
        if not keys:
            return func(*args, **kwargs)
        if _in_place(func, kwargs):
            new_args, new_kwargs = _replaced(args, kwargs, keys, int)
            return func(*new_args, **new_kwargs)
        expected = _untraced(func, args, kwargs)
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        candidates: list[Callable[[bool], Any]] = [int]
        if all(_takes(schemas, tensors, k, torch._C.TensorType) for k in keys):
            candidates.insert(0, lambda v: torch.tensor(v, device=device))
        for make in candidates:
            # made untraced: a tensor made while tracing warns that it is a constant (it is)
            new_args, new_kwargs = _untraced(_replaced, (args, kwargs, keys, make), {})
            try:
                trial = _untraced(func, new_args, new_kwargs)
            except Exception:  # noqa: BLE001  # that overload does not take it: try the next
                continue
            if _untraced(_same, (trial, expected), {}):
                return _cast_like(func(*new_args, **new_kwargs), expected)
        raise ExportError(
            f"ORTModule cannot trace {_name(func) or func} with a bool for a Scalar argument: the "
            "tracer records no schema for it, and neither a 0-d tensor nor the number 0 or 1 in "
            "its place computes the same; pass a number or a tensor instead."
        )


def _has_bool(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    return any(type(a) is bool for a in args) or any(type(v) is bool for v in kwargs.values())


def _name(func: Any) -> str | None:
    """The ATen operator a builtin torch function or ``Tensor`` method calls; None for a
    function written in Python (its own arguments need not match any ATen schema)."""
    if isinstance(func, types.FunctionType):
        return None
    name = getattr(func, "__name__", None)
    return _DUNDERS.get(name, name) if isinstance(name, str) else None


@functools.cache
def _schemas(func: Any) -> tuple[Any, ...]:
    name = _name(func)
    if name is None:
        return ()
    try:
        return tuple(torch._C._jit_get_schemas_for_operator(f"aten::{name}"))
    except RuntimeError:
        return ()


def _argument(schema: Any, key: Key) -> Any:
    """The schema argument a positional index or keyword lands on, or None."""
    if isinstance(key, str):
        return next((a for a in schema.arguments if a.name == key), None)
    positional = [a for a in schema.arguments if not a.kwarg_only]
    return positional[key] if key < len(positional) else None


def _is_type(t: Any, kind: type) -> bool:
    if isinstance(t, torch._C.OptionalType):
        t = t.getElementType()
    return isinstance(t, kind)


def _takes(schemas: Sequence[Any], tensors: Sequence[int], key: Key, kind: type) -> bool:
    """Whether an overload that fits the call's tensor arguments takes ``kind`` at ``key``, and
    none takes a ``bool`` there (a bool argument the tracer records fine)."""
    found = False
    for schema in schemas:
        if not all(
            (a := _argument(schema, i)) is not None and _is_type(a.type, torch._C.TensorType)
            for i in tensors
        ):
            continue
        arg = _argument(schema, key)
        if arg is None:
            continue
        if _is_type(arg.type, torch._C.BoolType):
            return False
        found = found or _is_type(arg.type, kind)
    return found


def _in_place(func: Any, kwargs: Mapping[str, Any]) -> bool:
    name = _name(func) or ""
    dunder = name.startswith("__") and name.endswith("__")
    return "out" in kwargs or (name.endswith("_") and not dunder) or name.startswith("__i")


def _replaced(
    args: Sequence[Any], kwargs: Mapping[str, Any], keys: Sequence[Key], make: Callable[[bool], Any]
) -> tuple[list[Any], dict[str, Any]]:
    return (
        [make(a) if i in keys else a for i, a in enumerate(args)],
        {k: make(v) if k in keys else v for k, v in kwargs.items()},
    )


def _untraced(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    state = torch._C._get_tracing_state()
    torch._C._set_tracing_state(None)  # type: ignore[attr-defined]  # no stub
    try:
        return func(*args, **kwargs)
    finally:
        torch._C._set_tracing_state(state)  # type: ignore[attr-defined]


def _cast_like(out: Any, expected: Any) -> Any:
    """``out`` with the dtypes of ``expected`` (a cast is traced when tracing)."""
    if isinstance(out, torch.Tensor) and isinstance(expected, torch.Tensor):
        return out if out.dtype == expected.dtype else out.to(expected.dtype)
    if isinstance(out, (tuple, list)) and isinstance(expected, (tuple, list)):
        if len(out) == len(expected):
            return type(out)([_cast_like(o, e) for o, e in zip(out, expected, strict=True)])
    return out


def _same(out: Any, expected: Any) -> bool:
    """Whether ``out`` cast to the dtypes of ``expected`` holds its shapes and values (NaN
    equal to NaN)."""
    out = _cast_like(out, expected)
    if isinstance(out, torch.Tensor) and isinstance(expected, torch.Tensor):
        if out.shape != expected.shape:
            return False
        if out.is_floating_point() or out.is_complex():
            return bool((out.eq(expected) | (out.isnan() & expected.isnan())).all())
        return torch.equal(out, expected)
    if isinstance(out, (tuple, list)) and isinstance(expected, (tuple, list)):
        return len(out) == len(expected) and all(
            _same(o, e) for o, e in zip(out, expected, strict=True)
        )
    return bool(out == expected)
