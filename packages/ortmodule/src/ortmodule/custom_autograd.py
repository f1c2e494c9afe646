"""Wire custom ``torch.autograd.Function`` support and the ATen fallback into the engine.

``ORTModule._setup()`` calls :func:`configure` with its options:

>>> from ortmodule.options import RuntimeOptions
>>> from ortmodule.custom_autograd import configure
>>> configure(RuntimeOptions.defaults())

It registers, once per process, the PythonOp runners, the ATen executor and the ATen gradients
with the engine. The export switches (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``,
``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT``, ``ORTMODULE_ATEN_SDPA_FALLBACK``,
``ORTMODULE_USE_EFFICIENT_ATTENTION``) are not set here: each ORTModule carries them in its
``ExportConfig`` (``runner_config.export_config``), which its exports apply for their own
duration, so two modules with different options never see each other's.
"""

from __future__ import annotations

from ortmodule_exporter.aten import executor as aten_executor
from ortmodule_exporter.aten import gradients as custom_gradients
from ortmodule_exporter.python_op import runner as python_op_runner

from .options import RuntimeOptions

__all__ = ["configure"]


def configure(options: RuntimeOptions) -> None:
    """Install the engine callbacks (idempotent); ``options`` reach the export through
    ``ExportConfig``, not here."""
    del options  # kept in the signature: callers pass theirs
    python_op_runner.install()
    aten_executor.install()
    custom_gradients.install_gradients()
