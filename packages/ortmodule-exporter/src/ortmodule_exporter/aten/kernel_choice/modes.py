"""The kernel choice's mode and the PyTorch thread count its measurements use.

An export's ``ExportConfig`` carries both; outside an export, the process defaults set by
:func:`~ortmodule_exporter.aten.kernel_choice.configure_kernel_choice` apply. Both are read
through :func:`current_mode` and :func:`current_torch_threads` (this module is their one owner).

>>> from ortmodule_exporter.aten.kernel_choice import current_mode
>>> current_mode() in MODES
True
"""

from __future__ import annotations

from ...active_export import active_export_config

__all__ = ["LOSSES", "MODES", "current_mode", "current_torch_threads", "measures"]

#: ``losses``: the losses (cross-entropy) and the built gradient graph's backward-only rewrites
#: (the engine's GELU gradients) are measured as under ``auto``, every other operator keeps
#: the engine's kernel. ORTModule's default under recompute: the engine recomputes only its
#: own nodes, nothing recomputes a loss, which comes after every layer, and recompute repeats
#: forward nodes, never a gradient.
LOSSES = "losses"
MODES = ("auto", "engine", "torch", LOSSES)


def measures(mode: str) -> bool:
    """Whether an export in ``mode`` may time kernels (its graph then holds this machine's
    decisions)."""
    return mode in ("auto", LOSSES)


# nothing is rerouted until a caller (ORTModule, through ExportConfig) asks for it
_MODE = ["engine"]
#: PyTorch's intra-op threads inside the engine (0: PyTorch's current count)
_TORCH_THREADS = [0]


def current_mode() -> str:
    """The mode of the export running in this context, else the process default that
    :func:`configure_kernel_choice` set last (``engine`` until it is called)."""
    active = active_export_config()
    return _MODE[0] if active is None else str(active.kernel_choice)


def current_torch_threads() -> int:
    """The PyTorch thread count the measurement uses (0: PyTorch's current count): the running
    export's, else the process default."""
    active = active_export_config()
    return _TORCH_THREADS[0] if active is None else int(active.kernel_choice_threads)


def _set_mode(mode: str, torch_threads: int | None) -> None:
    """Check and keep what ``configure_kernel_choice`` was given (None keeps the thread count)."""
    if mode not in MODES:
        raise ValueError(f"kernel choice mode must be one of {MODES}, got {mode!r}")
    if torch_threads is not None:
        if torch_threads < 0:
            raise ValueError(f"torch_threads must be >= 0, got {torch_threads}")
        _TORCH_THREADS[0] = torch_threads
    _MODE[0] = mode
