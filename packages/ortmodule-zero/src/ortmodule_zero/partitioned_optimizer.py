"""ZeRO stages 1 and 2 under ORTModule: the engine's CPU sessions allocate without the arena.

Stages 1 and 2 leave the parameters whole (nothing to gather: ORTModule runs them as without
DeepSpeed) and partition the optimizer states, and under stage 2 the gradients. Their
optimizer links each trainable parameter to its rank's fp32 partition (``_hp_mapping``, set on
every trainable parameter by ``deepspeed.utils.mixed_precision_linkage``, ``None`` where the
parameter lies in another rank's partition); DeepSpeed's bf16 optimizer does the same.

A module whose parameters are so linked is one whose user chose memory over time, as under
stage 3: an engine session built while it steps allocates without the CPU engine's arena
(``ORTMODULE_CPU_MEM_ARENA=AUTO``; ``1`` keeps it). The arena keeps a step's peak of engine
buffers resident beneath DeepSpeed's gradient partitions and the optimizer's step, which come
after the engine's backward. At 368M parameters on 2 gloo ranks (ZeRO-2, one window): the
rank's peak 9346 MiB with the arena, 8257 MiB without it (the freed heap handed back after each
backward, ``ortmodule_exporter.heap``), eager ZeRO-2 7950 MiB; steps 28.0, 27.2 and 28.3 s
(``benchmarks/results/2026-11-28-zero2-arena-amd-epyc-2c.md``).
"""

from __future__ import annotations

import sys

import torch

from ortmodule_exporter.components import StepContext

from .arena import ArenaFreeSteps

__all__ = ["ZeroOptimizerSessions", "linked_to_zero_optimizer"]


def linked_to_zero_optimizer(module: torch.nn.Module) -> bool:
    """Whether DeepSpeed's ZeRO stage 1/2 (or bf16) optimizer holds ``module``'s trainable
    parameters: the first one carries its link to the fp32 partition (``_hp_mapping``)."""
    if "deepspeed" not in sys.modules:
        return False  # one dict lookup on every step without DeepSpeed
    first = next((p for p in module.parameters() if p.requires_grad), None)
    return first is not None and hasattr(first, "_hp_mapping")


class ZeroOptimizerSessions(ArenaFreeSteps):
    """Marks a linked module as stepping, for :meth:`session_contribution`."""

    def pre_forward(self, ctx: StepContext) -> None:
        # asked at every step: deepspeed.initialize may come after a first forward
        if linked_to_zero_optimizer(ctx.module):
            self._stepping.add(ctx.module)

    def post_forward(self, ctx: StepContext, outputs: object) -> None:
        self._stepping.discard(ctx.module)
