"""Engine sessions built inside a ZeRO step allocate without the CPU engine's arena.

A ZeRO user chose memory over time. The arena (``ORTMODULE_CPU_MEM_ARENA=AUTO``; ``1`` keeps
it) keeps a step's peak of engine buffers resident beneath what follows the engine's backward:
DeepSpeed's gradient partitions, the optimizer's step and, under stage 3, the gathered model.
Without it a run's memory goes back when freed (GPT-2 124M in one process: steps 6-8 % slower).
"""

from __future__ import annotations

import weakref

import torch

from ortmodule_exporter.components import SessionContext, SessionContribution, StepHook

__all__ = ["ArenaFreeSteps"]


class ArenaFreeSteps(StepHook):
    """A step hook whose subclass marks a module as stepping (``_stepping``, from its
    ``pre_forward`` to its ``post_forward``: the module's sessions are built then); its
    :meth:`session_contribution` is registered as a session contributor."""

    def __init__(self) -> None:
        self._stepping: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def session_contribution(self, ctx: SessionContext) -> SessionContribution | None:
        """Session contributor: no CPU arena for a session built inside a marked step."""
        if ctx.device.type != "cpu" or not self._stepping:
            return None
        return SessionContribution(release_cpu_memory=True)
