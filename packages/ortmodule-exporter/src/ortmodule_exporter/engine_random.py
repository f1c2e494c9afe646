"""The engine's random numbers, seeded from PyTorch's generator so runs repeat.

The engine's random kernels (``Dropout`` and the ``Random*`` operators on CPU, ``Dropout`` and
``BitmaskDropout`` on CUDA) draw from process-wide generators that ONNX Runtime seeds from the
clock at load time (``utils::GetRandomSeed()``; ``PhiloxGenerator::Default()`` on CUDA). Left
alone, two runs of one script with ``torch.manual_seed`` fixed draw different dropout masks.

Before each run of a graph that draws, :func:`seed_engine` takes one number from PyTorch's
generator for the graph's device and hands it to the engine's ``set_seed``, which resets both
generators. The engine's draws are then a function of PyTorch's generator state, and PyTorch's
generator advances by one fixed step per run, so the same seed gives the same losses, run after
run and process after process. Graphs that draw nothing leave PyTorch's generator untouched (as
eager does for a model without randomness).

>>> import torch
>>> seed_engine(torch.device("cpu"))  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
import torch

from .engine_binding import _C

__all__ = ["RANDOM_OPS", "draws_random", "seed_engine", "seed_from_torch"]

#: node types whose engine kernels draw from the engine's default generators (a ``seed``
#: attribute gives a node a generator of its own, seeded when the session is created)
RANDOM_OPS = frozenset(
    {
        "Dropout",
        "BitmaskDropout",
        "BiasDropout",
        "BitmaskBiasDropout",
        "RandomNormal",
        "RandomNormalLike",
        "RandomUniform",
        "RandomUniformLike",
        "Multinomial",
        "Bernoulli",
    }
)

_SEED_MASK = (1 << 63) - 1


def _nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _nodes(sub)


def draws_random(model: onnx.ModelProto) -> bool:
    """Whether the engine draws from its default generators when it runs ``model``."""
    return any(
        node.op_type in RANDOM_OPS and not any(a.name == "seed" for a in node.attribute)
        for node in _nodes(model.graph)
    )


def seed_from_torch(device: torch.device) -> int:
    """A seed taken from PyTorch's generator for ``device``, advancing it by one fixed step.

    CPU: one int64 drawn from the default generator. CUDA: the device's Philox generator is
    read and moved on by one offset step instead of drawing on the device, which would make
    every step wait for the GPU to hand the number back.
    """
    if device.type == "cuda":
        generators = torch.cuda.default_generators
        if not generators:  # filled when CUDA initialises (an IndexError before)
            torch.cuda.init()
            generators = torch.cuda.default_generators
        generator = generators[
            device.index if device.index is not None else torch.cuda.current_device()
        ]
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # PyTorch's Philox offsets move in steps of 4
        return hash((generator.initial_seed(), offset)) & _SEED_MASK
    # one preallocated int64 (half the cost of a new tensor a step; a few µs in all)
    return int(_DRAW.random_()) & _SEED_MASK


_DRAW = torch.empty((), dtype=torch.int64)


def seed_engine(device: torch.device) -> None:
    """Seed the engine's default generators from PyTorch's (see the module's text)."""
    _C().set_seed(seed_from_torch(device))


def seed_engine_at_build() -> None:
    """Seed the engine from ``torch.initial_seed()`` without drawing from PyTorch's generator.

    Called before a session is created: the engine reads its seed while it builds too (the
    memory optimizer gives each recomputed ``Dropout`` a ``seed`` attribute from it), and
    without this the first build of a process would read the clock.
    """
    _C().set_seed(torch.initial_seed() & _SEED_MASK)
