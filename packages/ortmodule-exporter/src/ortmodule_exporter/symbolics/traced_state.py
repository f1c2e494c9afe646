"""The tensor behind a traced value, for symbolics that fold a frozen tensor into the graph.

While ORTModule exports, every state-dict entry of the module (parameters, buffers, and what a
module's ``_save_to_state_dict`` adds, such as bitsandbytes' 4-bit scales) that the forward
reads becomes a graph input named by its state-dict key. A symbolic that needs the numbers of
such a tensor at export time (to emit them as a ``Constant``) asks :func:`traced_tensor`; it
also reads ``Constant`` nodes. The state dict is collected only when a symbolic asks, once per
export, so exports that never ask pay nothing.

>>> with tracing_state_of(module):            # the exporter does this around the trace
...     torch.onnx.export(module, ...)        # inside a symbolic: traced_tensor(value)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from ..torchscript_onnx import symbolic_helper as sh

__all__ = ["traced_tensor", "tracing_state_of"]


class _State:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.tensors: dict[str, torch.Tensor] | None = None

    def get(self, name: str) -> torch.Tensor | None:
        if self.tensors is None:
            # the names torch.onnx gave the graph inputs: state-dict keys of the traced module
            self.tensors = dict(self.module.state_dict(keep_vars=True))
        return self.tensors.get(name)


_STATE: contextvars.ContextVar[_State | None] = contextvars.ContextVar(
    "ortmodule_traced_state", default=None
)


@contextlib.contextmanager
def tracing_state_of(module: torch.nn.Module) -> Iterator[None]:
    """Let symbolics read ``module``'s state-dict tensors while it is exported."""
    token = _STATE.set(_State(module))
    try:
        yield
    finally:
        _STATE.reset(token)


def traced_tensor(value: Any) -> torch.Tensor | None:
    """The tensor ``value`` stands for: a constant, or a state-dict entry of the exported module.

    ``None`` when the value is computed in the graph (or no export is under way): its numbers
    are not known at export time.
    """
    node = value.node()
    if node.kind() in ("onnx::Constant", "prim::Constant") and node.hasAttribute("value"):
        if node.kindOf("value") == "t":
            return node.t("value")  # type: ignore[no-any-return]
        return None
    if node.kind() == "prim::Param" and not sh._is_none(value):
        state = _STATE.get()
        return None if state is None else state.get(value.debugName())
    return None
