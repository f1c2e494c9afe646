"""How the wrapped module is called: its forward's arguments bound by name, and the buffers an
export watches for in-place writes. Shared by both export frontends."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch


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
