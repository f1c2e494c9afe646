"""ExportConfig: every setting that changes what an export writes, in one frozen object.

The runtime builds one from its options and passes it to :func:`ortmodule_exporter.export`.
The export is a function of it: the symbolic table is computed from it
(:func:`~ortmodule_exporter.symbolics.registry.symbolic_table`), and the routes, the PythonOp
export and the kernel choice read their switches from it through the context the export runs
in (:meth:`ExportConfig.applied`, :mod:`ortmodule_exporter.active_export`), so nothing is
installed into a module and two exports in two threads never see each other's settings. It is
hashed into the export-cache key (:meth:`ExportConfig.fingerprint`), so a changed option, a
newly registered symbolic or a new Function exporter can never return a graph exported without
it.

>>> config = ExportConfig(opset=17, custom_autograd=True, aten_sdpa_fallback=True)
>>> len(config.fingerprint())
64
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .. import python_op
from ..active_export import export_config_active
from ..aten import executor as aten_executor
from ..aten import kernel_choice
from ..aten import routes as aten_routes
from ..symbolics.registry import symbolic_table

__all__ = ["DEFAULT_OPSET", "FRONTENDS", "ExportConfig", "callable_source"]

DEFAULT_OPSET = 17

#: the export frontends (``ORTMODULE_EXPORTER``); the first is the default
FRONTENDS = ("torchscript", "torch_export")


@dataclass(frozen=True)
class ExportConfig:
    """What the TorchScript export of one graph depends on besides the module and its inputs.

    ``custom_autograd``: export ``torch.autograd.Function`` calls as PythonOp nodes the engine
    calls back into (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``); off inlines their forward.
    ``allow_autograd_checkpoint``: let ``torch.utils.checkpoint`` regions through as PythonOp.
    ``aten_sdpa_fallback`` / ``efficient_attention`` / ``aten_embedding``: route attention and
    embeddings with ``padding_idx`` to PyTorch through ATen nodes (see ``aten.routes``).
    """

    opset: int = DEFAULT_OPSET
    custom_autograd: bool = False
    allow_autograd_checkpoint: bool = False
    aten_sdpa_fallback: bool = False
    efficient_attention: bool = False
    aten_embedding: bool = False
    #: training-mode dropout on PyTorch's kernel, eager's masks (``ORTMODULE_ATEN_DROPOUT``)
    aten_dropout: bool = False
    #: ``kernel_choice.MODES``: which operators run on PyTorch's kernels (``ORTMODULE_KERNEL_CHOICE``)
    kernel_choice: str = "engine"
    #: PyTorch's threads while the engine runs PyTorch-run nodes (``ORTMODULE_TORCH_THREADS_IN_ENGINE``;
    #: 0: PyTorch's count): the kernel choice times PyTorch's kernels at this count
    kernel_choice_threads: int = 0
    #: which frontend writes the graph (``ORTMODULE_EXPORTER``): ``torchscript``, the TorchScript
    #: trace, or ``torch_export``, ``torch.export`` lowered by the dynamo ONNX translator
    frontend: str = "torchscript"

    def __post_init__(self) -> None:
        if self.frontend not in FRONTENDS:
            raise ValueError(
                f"ExportConfig.frontend={self.frontend!r} is not one of {', '.join(FRONTENDS)}"
            )
        if self.kernel_choice not in kernel_choice.MODES:
            raise ValueError(
                f"ExportConfig.kernel_choice={self.kernel_choice!r} is not one of "
                f"{', '.join(kernel_choice.MODES)}"
            )
        if self.kernel_choice_threads < 0:
            raise ValueError(
                f"ExportConfig.kernel_choice_threads={self.kernel_choice_threads} must be >= 0"
            )

    @classmethod
    def from_switches(cls, opset: int = DEFAULT_OPSET) -> ExportConfig:
        """The process-wide switches as they are now (``python_op.enable_custom_autograd``,
        ``aten_routes.configure_aten_routes``), for callers of ``export()`` that pass no
        config. ORTModule always passes one built from its options."""
        routes = aten_routes.aten_routes()
        return cls(
            opset=opset,
            custom_autograd=python_op.custom_autograd_enabled(),
            allow_autograd_checkpoint=python_op.allow_autograd_checkpoint(),
            aten_sdpa_fallback=routes.sdpa_fallback,
            efficient_attention=routes.efficient_attention,
            aten_embedding=routes.embedding,
            aten_dropout=routes.dropout,
            kernel_choice=kernel_choice.current_mode(),
            kernel_choice_threads=kernel_choice.current_torch_threads(),
        )

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Make this config the one in force in this context (thread, task) for one export."""
        with export_config_active(self):
            yield

    def fingerprint(self) -> str:
        """A SHA-256 of this config and of everything registered that the export consults:
        its symbolic table (by name, opset and source), Function exporters and whether the
        ATen executor is installed (ATen fallback on or off)."""
        h = hashlib.sha256()
        for item in dataclasses.fields(self):
            h.update(f"{item.name}={getattr(self, item.name)!r}\n".encode())
        h.update(f"aten_executor={aten_executor.installed()}\n".encode())
        symbolics = symbolic_table(self)
        for op in sorted(symbolics):
            entry = symbolics[op]
            h.update(f"symbolic {op} {entry.opset}\n".encode())
            h.update(callable_source(entry.fn).encode())
        for name, handler in sorted(python_op.python_op_exporters().items()):
            h.update(f"function exporter {name}\n".encode())
            h.update(callable_source(handler).encode())
        return h.hexdigest()


_SOURCES: dict[int, tuple[Callable[..., Any], str]] = {}


def callable_source(fn: Callable[..., Any]) -> str:
    """``fn``'s qualified name and source (its repr when it has none), cached per object."""
    cached = _SOURCES.get(id(fn))
    if cached is not None and cached[0] is fn:
        return cached[1]
    target = getattr(fn, "__wrapped__", fn)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    try:
        text = name + "\n" + inspect.getsource(target)
    except (OSError, TypeError):
        text = name + "\n" + repr(target)
    _SOURCES[id(fn)] = (fn, text)
    return text
