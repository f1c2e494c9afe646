"""Where in a module an operator is called: the submodule path for an export error message.

When the export fails at an operator, the module is run once more in eager (no gradient, its
buffers and the RNG restored) while a ``TorchFunctionMode`` watches for a call of that operator
and forward hooks keep the stack of submodules being run. The first submodule that calls it is
named in the error (``model.layers.0.self_attn``), so the user knows which layer to change or
which symbolic to register. Only the failure path pays for this.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["locate_operator"]


def _names(op: str) -> set[str]:
    """Python-side names under which the ATen operator ``op`` can be called."""
    name = op.removeprefix("aten::").split(".")[0]
    base = name.rstrip("_")
    names = {name, base, f"{base}_"}
    if base.startswith("special_"):
        names.add(base.removeprefix("special_"))
    return names


class _Watch(TorchFunctionMode):
    def __init__(self, wanted: set[str], stack: list[str]) -> None:
        super().__init__()
        self.wanted = wanted
        self.stack = stack
        self.found: str | None = None

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if self.found is None and getattr(func, "__name__", None) in self.wanted:
            self.found = self.stack[-1] if self.stack else ""
        return func(*args, **(kwargs or {}))


def locate_operator(
    module: torch.nn.Module, call: Callable[[torch.nn.Module], Any], op: str
) -> str | None:
    """The qualified name of the first submodule of ``module`` whose forward calls ``op``
    (``""`` for the module itself), or None when ``call(module)`` does not call it."""
    stack: list[str] = []
    handles = []
    for name, sub in module.named_modules():

        def enter(_m: Any, _a: Any, name: str = name) -> None:
            stack.append(name)

        def leave(_m: Any, _a: Any, _o: Any) -> None:
            if stack:
                stack.pop()

        handles.append(sub.register_forward_pre_hook(enter))
        handles.append(sub.register_forward_hook(leave, always_call=True))
    watch = _Watch(_names(op), stack)
    try:
        with torch.no_grad(), watch:
            call(module)
    except Exception:  # the search is best effort: the export error is what the user gets
        pass
    finally:
        for handle in handles:
            handle.remove()
    return watch.found
