"""``tensor.data`` is traced as ``tensor.detach()``.

The TorchScript tracer of torch 2.13 does not record ``.data``: the tensor it returns shares
the storage but not the trace, so whatever is computed from it is recorded as a constant, the
value of the traced call. ``self.x_min = self.x_min + x.data.min()`` (I-BERT's activation range)
or ``self.buf.copy_(y.data.mean())`` then adds the minimum of the traced batch on every call,
a silently wrong buffer. While the export traces, a ``TorchFunctionMode`` answers ``.data``
with ``.detach()``: the same values and no gradient, recorded in the graph.

The one difference from ``.data``: the detached tensor shares the version counter, so an
in-place write through it is seen as a write to the original (the export then records a
buffer written that way, which the trace could not see before).

>>> x = torch.randn(3)
>>> with data_as_detach():
...     graph, _ = torch.jit._get_trace_graph(lambda x: x + x.data.min(), (x,))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["data_as_detach"]

_DATA_GET = torch.Tensor.data.__get__  # type: ignore[attr-defined]


@contextlib.contextmanager
def data_as_detach() -> Iterator[None]:
    """For one export's trace: ``tensor.data`` is recorded as ``tensor.detach()``."""
    with _DataAsDetach():
        yield


class _DataAsDetach(TorchFunctionMode):
    def __torch_function__(
        self, func: Any, types_: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        if (
            func == _DATA_GET
            and torch._C._get_tracing_state() is not None
            and args
            and isinstance(args[0], torch.Tensor)
        ):
            return args[0].detach()
        return func(*args, **(kwargs or {}))
