"""The sizes each operator had while the export traced the module (the exported graph's own dims
are dynamic), which the families' symbolics class their operator by; also whether each tensor
argument needed a gradient, a cross-entropy's label density, and whether a traced tensor was
off the CPU (the measurements time CPU kernels).

>>> from ortmodule_exporter.aten.kernel_choice import recording_traced_sizes
>>> with recording_traced_sizes():
...     pass  # torch.onnx.export(...)
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...label_density import label_density
from ..symbolic_helpers import traced_sizes
from .modes import current_mode

_TRACE = threading.local()


@dataclass(frozen=True)
class _Traced:
    """One traced operator: its inputs' sizes (in the traced node's order) and which of its
    tensor arguments (in the Python call's order) need a gradient (an ATen node's gradient
    definition writes every input gradient it names, and the engine fails on one nobody needs)."""

    sizes: list[tuple[int, ...] | None]
    needs_grad: tuple[bool, ...]
    #: a cross-entropy's share of labels that count (not ``ignore_index``); None for others
    label_density: float | None = None

    @property
    def input_needs_grad(self) -> bool:
        return bool(self.needs_grad and self.needs_grad[0])


class _SizeRecorder(TorchFunctionMode):
    """Records the input sizes of every traced operator, per (scope, kind), in trace order."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[tuple[str, str], list[_Traced]] = {}
        self._seen: set[int] = set()
        #: whether a traced operator had a tensor off the CPU (the timings are CPU ones)
        self.off_cpu = False

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch._C._get_tracing_state() is None:
            return out
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor):
            try:
                value = torch._C._get_value_trace(first)  # type: ignore[attr-defined]
            except RuntimeError:  # not a traced value (a constant)
                return out
            if value.unique() not in self._seen:
                self._seen.add(value.unique())
                node = value.node()
                key = (node.scopeName(), node.kind().rstrip("_"))
                given = [*args, *(kwargs or {}).values()]
                if any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in given):
                    self.off_cpu = True
                self.sizes.setdefault(key, []).append(
                    _Traced(
                        [_complete_sizes(v) for v in node.inputs()],
                        tuple(a.requires_grad for a in given if isinstance(a, torch.Tensor)),
                        _label_density(func, args, kwargs or {}),
                    )
                )
        return out


def _label_density(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> float | None:
    """The share of counted labels of a traced ``F.cross_entropy`` call (what label sparsity
    decides on, from the same first batch); None for any other operator."""
    if func is not F.cross_entropy:
        return None
    bound = _CROSS_ENTROPY_SIGNATURE.bind(*args, **kwargs)
    target = bound.arguments.get("target")
    if not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # class probabilities, not indices
    ignore_index = bound.arguments.get("ignore_index", -100)
    with warnings.catch_warnings():
        # read during the trace: the tracer's warning would name this line to the user
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return label_density(target.detach().cpu().numpy(), ignore_index)


_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)


def _complete_sizes(value: Any) -> tuple[int, ...] | None:
    """A traced value's sizes when all of them are known, else None."""
    sizes = traced_sizes(value)
    if sizes is None or any(s is None for s in sizes):
        return None
    return tuple(int(s) for s in sizes)  # type: ignore[arg-type]


@contextlib.contextmanager
def recording_traced_sizes() -> Iterator[None]:
    """For one export: remember the concrete sizes each operator had while it was traced, so
    the symbolics can class it (the exported graph's dims are dynamic). Does nothing in mode
    ``engine``, where no symbolic reads them."""
    if current_mode() == "engine":
        yield
        return
    previous = getattr(_TRACE, "recorder", None)
    recorder = _SizeRecorder()
    _TRACE.recorder = recorder
    try:
        with recorder:
            yield
    finally:
        _TRACE.recorder = previous


def _traced(g: Any) -> _Traced | None:
    """What the operator being exported had when it was traced, or None."""
    recorder = getattr(_TRACE, "recorder", None)
    node = getattr(g, "original_node", None)
    if recorder is None or node is None:
        return None
    key = (node.scopeName(), node.kind().rstrip("_"))
    seen = recorder.sizes.get(key)
    if not seen:
        return None
    # the n-th such operator of this module scope in the graph is the n-th one traced
    ordinal = 0
    other = node.prev()
    while other.kind() not in ("prim::Param", "prim::Return"):
        if (other.scopeName(), other.kind().rstrip("_")) == key:
            ordinal += 1
        other = other.prev()
    return seen[ordinal] if ordinal < len(seen) else None


def _recording_off_cpu() -> bool:
    """Whether the export being traced had an operator with a tensor off the CPU."""
    recorder = getattr(_TRACE, "recorder", None)
    return recorder is not None and recorder.off_cpu
