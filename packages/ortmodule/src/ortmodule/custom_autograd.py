"""Wire custom ``torch.autograd.Function`` support and the ATen fallback into the engine.

``ORTModule._setup()`` calls :func:`configure` with its options:

>>> from ortmodule.options import RuntimeOptions
>>> from ortmodule.custom_autograd import configure
>>> configure(RuntimeOptions.defaults())

It registers, once per process, the PythonOp runners, the ATen executor and the ATen gradients
with the engine, then applies the switches (``ORTMODULE_ENABLE_CUSTOM_AUTOGRAD``,
``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT``, ``ORTMODULE_ATEN_SDPA_FALLBACK``,
``ORTMODULE_USE_EFFICIENT_ATTENTION``). The switches are process-wide, like the environment
variables they come from: the last ORTModule created decides them for later exports.
"""

from __future__ import annotations

from ortmodule_exporter import (
    aten_executor,
    aten_fallback,
    custom_gradients,
    kernel_choice,
    python_op,
    python_op_runner,
)

from .options import RuntimeOptions

__all__ = ["configure"]


def configure(options: RuntimeOptions) -> None:
    """Install the engine callbacks (idempotent) and apply ``options``' export switches."""
    python_op_runner.install()
    aten_executor.install()
    custom_gradients.install_gradients()
    python_op.enable_custom_autograd(
        options.enable_custom_autograd, options.allow_autograd_checkpoint
    )
    aten_fallback.configure_aten_routes(
        sdpa_fallback=options.aten_sdpa_fallback or options.fused_attention,
        efficient_attention=options.use_efficient_attention,
    )
    kernel_choice.configure_kernel_choice(options.kernel_choice.lower())
