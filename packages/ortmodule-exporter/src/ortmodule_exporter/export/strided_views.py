"""``as_strided`` is traced from the memory layout of its input, not its logical order.

``torch.onnx``'s symbolic for ``aten::as_strided`` gathers from the input flattened in logical
order, which is the input's memory only when the input is contiguous. A view that is not
(``q.transpose(1, 2).reshape(b * h, s, d)`` stays a view; Longformer's and LED's sliding-window
chunking then calls ``as_strided`` on it with strides read from that view) was gathered from the
wrong elements: silently wrong attention scores.

While the export traces, a ``TorchFunctionMode`` answers ``as_strided`` on a non-contiguous
tensor whose elements are dense in memory (any order of dimensions, no gaps, no overlap) with the same
elements gathered from the input put in memory order: the dimensions sorted by stride and
flattened, then ``index_select`` with the element offsets ``as_strided`` would read. The offsets
are constants of the traced sizes; the sizes are read with ``int()``, which the exporter guards,
so other sizes export again. An ``as_strided`` that reads memory outside its input's elements, or
on an input with gaps or overlaps, raises :class:`ExportError`: the graph only has the input's
values, not the rest of the storage.

>>> q = torch.randn(1, 8, 2, 4)
>>> with strided_views_traced():
...     graph, _ = torch.jit._get_trace_graph(
...         lambda q: q.transpose(1, 2).reshape(2, 8, 4).as_strided((2, 3, 4, 4), (4, 16, 8, 1)),
...         (q,),
...     )
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..errors import ExportError

__all__ = ["strided_views_traced"]

_AS_STRIDED = {torch.Tensor.as_strided, torch.as_strided}


@contextlib.contextmanager
def strided_views_traced() -> Iterator[None]:
    """For one export's trace: ``as_strided`` reads its input's memory as eager does."""
    with _StridedViews():
        yield


def _memory_order(x: torch.Tensor) -> list[int] | None:
    """The dimensions of ``x`` from the largest stride to the smallest, when its elements fill
    a block of memory without gaps or overlaps; None otherwise."""
    strides = x.stride()
    dims = sorted((d for d in range(x.dim()) if x.size(d) != 1), key=lambda d: -strides[d])
    expected = 1
    for d in reversed(dims):
        if strides[d] != expected:
            return None
        expected *= int(x.size(d))
    return [*dims, *(d for d in range(x.dim()) if x.size(d) == 1)]


def _gathered(
    x: torch.Tensor, size: Sequence[Any], stride: Sequence[int], offset: int | None
) -> torch.Tensor:
    sizes = [int(s) for s in size]  # a traced size becomes a guarded value
    strides = [int(s) for s in stride]
    start = 0 if offset is None else int(offset) - int(x.storage_offset())
    index = torch.full((), start, dtype=torch.long)
    for i, (n, st) in enumerate(zip(sizes, strides, strict=True)):
        shape = [1] * len(sizes)
        shape[i] = n
        index = index + torch.arange(n, dtype=torch.long).reshape(shape) * st
    order = _memory_order(x)
    numel = x.numel()
    if order is None or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= numel)):
        raise ExportError(
            f"as_strided(size={sizes}, stride={strides}, storage_offset={offset}) on a tensor of "
            f"shape {tuple(x.shape)} and strides {tuple(x.stride())} reads memory outside that "
            "tensor's elements, which the exported graph does not have. Compute the view from "
            "a contiguous tensor (x.contiguous().as_strided(...)), or use unfold / slicing."
        )
    flat = x.permute(order).reshape(-1) if order != list(range(x.dim())) else x.reshape(-1)
    return flat.index_select(0, index.reshape(-1)).reshape(sizes)


class _StridedViews(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types_: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _AS_STRIDED and torch._C._get_tracing_state() is not None:
            bound = _arguments(*args, **kwargs)
            # a contiguous input's logical order is its memory order: torch.onnx's symbolic
            # reads it right (and keeps its sizes dynamic)
            if bound is not None and not bound[0].is_contiguous():
                return _gathered(*bound)
        return func(*args, **kwargs)


def _arguments(
    input: Any, size: Any, stride: Any, storage_offset: Any = None
) -> tuple[torch.Tensor, Sequence[Any], Sequence[int], int | None] | None:
    if not isinstance(input, torch.Tensor):
        return None
    return input, list(size), list(stride), storage_offset
