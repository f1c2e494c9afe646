"""Built-graph passes: edits of the model the engine built (with its gradient nodes), made
before a session runs it.

A post-export pass sees the forward graph only; some fixes need the nodes the engine's gradient
builders wrote (a backward node the engine's CPU kernel computes wrongly, for example). A pass
gets the built ``onnx.ModelProto`` and the :class:`~ortmodule_exporter.engine.GraphConfig`, edits
the model in place and returns whether it changed anything. It must keep the graph's inputs and
outputs (the runtime feeds and fetches them by name).

>>> def tag(model, config):
...     model.doc_string = "seen"
...     return True
>>> register_built_graph_pass("tag", tag, order=50)
>>> unregister_built_graph_pass("tag")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx

from ..ordered import OrderedRegistry, Registered

__all__ = [
    "BuiltGraphPass",
    "built_graph_passes",
    "register_built_graph_pass",
    "run_built_graph_passes",
    "unregister_built_graph_pass",
]

BuiltPassFn = Callable[[onnx.ModelProto, Any], bool]


BuiltGraphPass = Registered[BuiltPassFn]

_PASSES: OrderedRegistry[BuiltPassFn] = OrderedRegistry()


def register_built_graph_pass(name: str, fn: BuiltPassFn, order: int = 100) -> None:
    """Run ``fn(model, graph_config) -> changed`` on every built graph; lower ``order`` first."""
    _PASSES.register(name, fn, order)


def unregister_built_graph_pass(name: str) -> None:
    _PASSES.unregister(name)


def built_graph_passes() -> tuple[BuiltGraphPass, ...]:
    """The registered built-graph passes, in the order they run."""
    return _PASSES.in_order()


def run_built_graph_passes(model_bytes: bytes, config: Any) -> bytes:
    """The built model after every registered pass (the same bytes when none changed it)."""
    passes = _PASSES.in_order()
    if not passes:
        return model_bytes
    model = onnx.load_from_string(model_bytes)
    changed = False
    for p in passes:
        changed = bool(p.fn(model, config)) or changed
    return model.SerializeToString() if changed else model_bytes
