"""The one place that reaches into torch.onnx between the trace and its lowering to ONNX.

torch.onnx's TorchScript exporter (torch 2.13) traces the module, then hands the traced graph to
its private ``_optimize_graph``, which runs the JIT passes and converts every node to ONNX. It
offers no hook in between, and the exporter needs two: cutting the gradient where the forward
detached a value (:mod:`.gradient_cuts`) and forgetting the sizes the trace saw
(:mod:`.traced_sizes`). ``_optimize_graph`` is wrapped once per process; the wrapper runs the
hooks entered with :func:`before_lowering` in this context only, so other ``torch.onnx.export``
calls (and other threads) are unchanged.

>>> with before_lowering(print_graph):     # print_graph(graph) sees the traced graph
...     torch.onnx.export(module, ...)
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..torchscript_onnx import export_utils

__all__ = ["before_lowering"]

Hook = Callable[[torch._C.Graph], None]

_HOOKS: contextvars.ContextVar[tuple[Hook, ...]] = contextvars.ContextVar(
    "ortmodule_lowering_hooks", default=()
)
_INSTALL_LOCK = threading.Lock()


def _wrap(optimize_graph: Any) -> Any:
    @functools.wraps(optimize_graph)
    def optimize(graph: torch._C.Graph, *args: Any, **kwargs: Any) -> Any:
        for hook in _HOOKS.get():
            hook(graph)
        return optimize_graph(graph, *args, **kwargs)

    optimize._ortmodule_hooks = True  # type: ignore[attr-defined]
    return optimize


def _install(purpose: str) -> None:
    with _INSTALL_LOCK:
        utils = export_utils
        current = getattr(utils, "_optimize_graph", None)
        if current is None:  # pragma: no cover
            raise RuntimeError(
                f"ORTModule cannot {purpose} with this torch: "
                "torch.onnx's TorchScript exporter has no _optimize_graph"
            )
        if not getattr(current, "_ortmodule_hooks", False):
            utils._optimize_graph = _wrap(current)


@contextlib.contextmanager
def before_lowering(hook: Hook, purpose: str) -> Iterator[None]:
    """Run ``hook`` on each traced graph torch.onnx lowers in this context, after earlier hooks.

    ``purpose`` completes the error raised when this torch has no such step: "ORTModule cannot
    <purpose> with this torch".
    """
    _install(purpose)
    token = _HOOKS.set((*_HOOKS.get(), hook))
    try:
        yield
    finally:
        _HOOKS.reset(token)
