"""A built graph ready to run: its session, how to feed it from the module and the user's
inputs, its guards, and the module buffers its forward updates (written back as eager would).

>>> from ortmodule.compiled_graph import BufferUpdate, CompiledGraph
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ortmodule_exporter import GraphKey, Guard
from ortmodule_exporter.engine import BuiltGraph, InferenceSession, TrainingSession
from ortmodule_exporter.export.shape_guards import ShapeGuard

from .log import PhaseTimer

__all__ = [
    "FLOAT_TYPES",
    "BufferUpdate",
    "CompiledGraph",
    "apply_buffer_updates",
    "kept_variances",
]

#: the dtypes that carry a gradient
FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class BufferUpdate:
    """A graph output that holds a module buffer's new value."""

    index: int
    owner: torch.nn.Module
    attr: str
    #: for a running variance: the output holding elements per channel, else -1
    count_index: int = -1
    #: the weight of the old value in the engine's update (ONNX BatchNorm momentum)
    momentum: float = 0.0


def kept_variances(updates: list[BufferUpdate]) -> list[torch.Tensor]:
    """Before the engine runs: momentum * the old running variance, for each variance update.

    The engine's training BatchNorm overwrites the running buffers in place (they are its
    feeds), so the part of the old value the update keeps is taken first, in one call.
    """
    of_variances = [u for u in updates if u.count_index >= 0]
    if not of_variances:
        return []
    with torch.no_grad():
        return list(
            torch._foreach_mul(
                [getattr(u.owner, u.attr) for u in of_variances], [u.momentum for u in of_variances]
            )
        )


def apply_buffer_updates(
    updates: list[BufferUpdate], outputs: Sequence[torch.Tensor], kept: list[torch.Tensor]
) -> None:
    """Leave the module's buffers as eager BatchNorm would have left them.

    The engine folds the population variance into a running variance, PyTorch the unbiased
    one: new = kept + (engine - kept) * n/(n-1), with kept = momentum * old
    (:func:`kept_variances`) and n elements per channel. The buffers are updated in place, a
    few batched calls for all layers (the same arithmetic, in the same order, per element).
    """
    kept_iter = iter(kept)
    variances: list[torch.Tensor] = []
    keeps: list[torch.Tensor] = []
    factors: list[float] = []
    tracked: list[torch.Tensor] = []
    with torch.no_grad():
        for u in updates:
            value = outputs[u.index]
            buffer = getattr(u.owner, u.attr)
            buffer.copy_(value)  # the engine wrote a copy of the buffer (``GraphRunner._bind``)
            if u.count_index >= 0:
                keep = next(kept_iter)
                n = int(outputs[u.count_index])
                if n > 1:
                    variances.append(buffer)
                    keeps.append(keep)
                    factors.append(n / (n - 1))
            elif u.attr == "running_mean":
                count = getattr(u.owner, "num_batches_tracked", None)
                if count is not None:
                    tracked.append(count)
        if variances:
            torch._foreach_sub_(variances, keeps)
            torch._foreach_mul_(variances, factors)
            torch._foreach_add_(variances, keeps)
        if tracked:
            torch._foreach_add_(tracked, 1)


@dataclass
class CompiledGraph:
    """A built graph, its session, and how to feed it from the module and the user's inputs."""

    key: GraphKey
    built: BuiltGraph
    session: TrainingSession | InferenceSession
    #: for each feed: ("input", index into flat user tensors), ("extra", (input, device)) or
    #: ("param", (owner module, attr, its _parameters or _buffers dict holding attr, or None))
    feeds: list[tuple[str, Any]]
    #: for each forward output: index into the user's flat outputs, or the buffer it updates
    output_count: int
    buffer_updates: list[BufferUpdate]
    times: PhaseTimer
    #: for each feed position: index into the backward outputs, or -1 for no gradient
    grad_index: list[int] = field(default_factory=list)
    #: forward outputs handed back without a gradient: the engine's non-differentiable outputs
    #: and those eager computes without one (``ExportedModel.outputs_without_grad``)
    without_grad: frozenset[int] = frozenset()
    #: (forward output index, flat user input index): an input the forward writes in place
    input_writes: list[tuple[int, int]] = field(default_factory=list)
    #: (forward output index, guard): a tensor -> Python conversion the trace baked in
    guards: list[tuple[int, Guard]] = field(default_factory=list)
    #: conversions of sizes, checked from the inputs' shapes before the graph runs
    shape_guards: list[ShapeGuard] = field(default_factory=list)
    #: graph input name -> index into the flat user tensors, for the shape guards
    shape_inputs: dict[str, int] = field(default_factory=dict)
    _shapes_checked: tuple[Any, ...] | None = None
    #: forward outputs handed back as copies: views of a buffer the engine reuses in backward
    #: (see :func:`_viewed_outputs`)
    copied_outputs: frozenset[int] = frozenset()
    _reached: dict[frozenset[int], frozenset[str]] = field(default_factory=dict)
    _returned: dict[frozenset[int], list[int]] = field(default_factory=dict)
    _backward_feeds: tuple[tuple[int, torch.dtype, torch.device], ...] | None = None

    def backward_feeds(
        self, outputs: Sequence[torch.Tensor] = ()
    ) -> tuple[tuple[int, torch.dtype, torch.device], ...]:
        """The forward outputs whose gradients the backward half takes, in its feed order,
        with their dtype and device (fixed by the graph; taken from the first call's
        ``outputs``): every output but the engine's non-differentiable and non-float ones."""
        found = self._backward_feeds
        if found is None:
            non_diff = self.built.non_differentiable_outputs
            found = tuple(
                (i, out.dtype, out.device)
                for i, out in enumerate(outputs)
                if i not in non_diff and out.dtype in FLOAT_TYPES
            )
            self._backward_feeds = found
        return found

    def returned_grads(self, used: frozenset[int]) -> list[int]:
        """Per feed, the backward output handed to autograd, or -1 for None (memoised).

        Like eager, an input that reaches no output with a gradient gets None, not zeros.
        """
        found = self._returned.get(used)
        if found is None:
            reached = self.reached_by(used)
            found = [
                j if j >= 0 and name in reached else -1
                for j, name in zip(self.grad_index, self.built.feed_names, strict=True)
            ]
            self._returned[used] = found
        return found

    def failed_guard(self, outputs: Sequence[torch.Tensor]) -> int | None:
        """The position (in :attr:`guards`) of the first guard whose value changed, if any."""
        for position, (index, guard) in enumerate(self.guards):
            if not guard.holds(outputs[index]):
                return position
        return None

    def fits_shapes(self, flat: Sequence[torch.Tensor]) -> bool:
        return self.failed_shape_guard(flat) is None

    def failed_shape_guard(
        self, flat: Sequence[torch.Tensor]
    ) -> tuple[ShapeGuard, torch.Tensor] | None:
        """The first shape guard that does not hold for these inputs and its value now, if
        any (checked once per new set of input shapes)."""
        shapes = tuple(flat[i].shape for i in self.shape_inputs.values())
        if shapes == self._shapes_checked:
            return None
        inputs = self.shape_inputs
        for guard in self.shape_guards:
            now = guard.value(lambda name: flat[inputs[name]].shape)
            if not guard.guard.holds(now):
                return guard, now
        self._shapes_checked = shapes
        return None

    def guards_hold_for(self, other: CompiledGraph, outputs: Sequence[torch.Tensor]) -> bool:
        """Whether ``other``'s outputs (a run of ``other``) give this graph's guard values at
        the same places: then this graph's trace took the same path up to its guards."""
        if [g.source for _, g in self.guards] != [g.source for _, g in other.guards]:
            return False
        return all(
            mine.holds(outputs[index])
            for (_, mine), (index, _) in zip(self.guards, other.guards, strict=True)
        )

    def reached_by(self, outputs: frozenset[int]) -> frozenset[str]:
        """Graph inputs that any of ``outputs`` depends on (memoised per set of outputs)."""
        found = self._reached.get(outputs)
        if found is None:
            deps = self.built.output_dependencies
            found = frozenset().union(*(deps[i] for i in outputs if i < len(deps)))
            self._reached[outputs] = found
        return found
