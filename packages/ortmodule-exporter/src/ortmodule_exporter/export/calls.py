"""How the wrapped module is called: its forward's arguments bound by name, the buffers an
export watches for in-place writes, and the parameters it refuses writes to. Shared by both
export frontends."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import ExportError


def module_path(module: torch.nn.Module) -> str:
    """The module's qualified class name, as errors name it."""
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def forward_signature(module: torch.nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def bind_arguments(
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    signature: inspect.Signature | None = None,
) -> dict[str, Any]:
    """The forward call as an ordered {parameter name: value} dict, so names are readable and a
    positional and a keyword call of the same argument give the same schema."""
    sig = signature or forward_signature(module)
    try:
        if sig is None:
            raise TypeError("no signature")
        bound = sig.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return {"args": tuple(args), "kwargs": dict(kwargs)}
    return dict(bound.arguments)


def call_bound(module: torch.nn.Module, arguments: Mapping[str, Any]) -> Any:
    try:
        sig = inspect.signature(module.forward)
        bound = inspect.BoundArguments(sig, dict(arguments))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return module(*arguments["args"], **arguments["kwargs"])
    return module(*bound.args, **bound.kwargs)


# buffers the BatchNorm pass already keeps in step (``passes.batchnorm``): their in-place update
# happens inside the kernel, so the trace holds no new value for them
_NORM_STATS = torch.nn.modules.batchnorm._NormBase


def writable_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's buffers by qualified name, but for the running statistics of norm layers."""
    found = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, _NORM_STATS):
            continue
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None:
                found[f"{prefix}.{name}" if prefix else name] = buf
    return found


class ParameterWrites:
    """Watches the parameters of ``module`` from its creation to :meth:`refuse`, which raises
    where the forward wrote one in place (``nn.Embedding(max_norm=...)`` renormalizes the rows
    it looks up; ``weight.mul_()`` under ``torch.no_grad()``) or gave it a new tensor.

    The engine takes parameters as graph inputs: such a write would happen in the trace only,
    and the engine's losses, gradients and weights would silently differ from eager's from the
    first step on (a buffer's write, by contrast, becomes a graph output written back on every
    call). Under the default fallback policy PyTorch then runs the module; the trace wrote
    into the export's deep copy, not the user's parameters.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._before = dict(module.named_parameters())
        self._versions = {name: p._version for name, p in self._before.items()}

    def refuse(self) -> None:
        after = dict(self._module.named_parameters())
        written = [
            name
            for name, param in self._before.items()
            if after.get(name) is not param or param._version != self._versions[name]
        ]
        if not written:
            return
        where = module_path(self._module)
        names = ", ".join(repr(n) for n in written)
        raise ExportError(
            f"{where}: the forward writes parameter(s) {names} in place or replaces them. "
            "ORTModule passes parameters to the engine as inputs and does not write them back, "
            "so its results would differ from PyTorch's. An nn.Embedding with max_norm "
            "renormalizes the rows it looks up in place: renormalize outside forward (before "
            "the optimizer step) or drop max_norm; compute any other new weight out of place "
            "(w = w * s, not w.mul_(s)); or let ORTModule run this module in PyTorch "
            "(ORTMODULE_FALLBACK_POLICY).",
            module_path=where,
        )
