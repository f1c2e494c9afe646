"""flatten + unflatten speed: ORTModule runs both on every training step.

Builds a 100-leaf nested structure (dicts, lists, tuples, namedtuples, a dataclass; tensors and
flags), then times ``ortmodule_pytree.flatten`` and ``unflatten`` with ``timeit``, reporting the
median over repeats in microseconds. The same structure with tuples in place of the dataclasses
is timed against torch's own ``tree_flatten`` + ``TreeSpec.unflatten`` in the same run: that
ratio is the number to compare across machines.

    python benchmarks/bench_pytree.py
"""

from __future__ import annotations

import dataclasses
import statistics
import timeit
from collections import namedtuple
from typing import Any

import torch
import torch.utils._pytree as torch_pytree

import ortmodule_pytree

Attention = namedtuple("Attention", ["key", "value", "causal"])


@dataclasses.dataclass
class Block:
    hidden: torch.Tensor
    attention: Attention
    scale: float


def make_structure(num_blocks: int = 20) -> Any:
    """Five leaves per block: hidden, key, value, causal flag, scale -> 100 leaves for 20."""
    blocks = [
        Block(torch.zeros(2, 8), Attention(torch.zeros(2, 4), torch.zeros(2, 4), True), 0.5)
        for _ in range(num_blocks)
    ]
    return {"blocks": blocks[: num_blocks // 2], "rest": tuple(blocks[num_blocks // 2 :])}


def _median_us(fn: Any, number: int, repeat: int) -> float:
    times = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(times) / number * 1e6


def run(number: int = 200, repeat: int = 7) -> dict[str, float]:
    """Microseconds per call (median of ``repeat`` runs of ``number`` calls each)."""
    obj = make_structure()
    tensors, schema = ortmodule_pytree.flatten(obj)
    ortmodule_pytree.unflatten(tensors, schema)  # compile the per-schema unflatten once
    num_leaves = schema.treespec.num_leaves

    flatten_us = _median_us(lambda: ortmodule_pytree.flatten(obj), number, repeat)
    unflatten_us = _median_us(lambda: ortmodule_pytree.unflatten(tensors, schema), number, repeat)
    round_trip_us = _median_us(
        lambda: ortmodule_pytree.unflatten(*ortmodule_pytree.flatten(obj)), number, repeat
    )

    # The same structure with each dataclass as a tuple: what torch's pytree handles natively.
    plain = {key: [(b.hidden, b.attention, b.scale) for b in value] for key, value in obj.items()}
    plain_round_trip_us = _median_us(
        lambda: ortmodule_pytree.unflatten(*ortmodule_pytree.flatten(plain)), number, repeat
    )
    # torch's own tree_flatten + TreeSpec.unflatten on it, as the in-run reference.
    leaves, _ = torch_pytree.tree_flatten(plain)
    torch_round_trip_us = _median_us(
        lambda: torch_pytree.tree_flatten(plain)[1].unflatten(leaves), number, repeat
    )
    return {
        "leaves": float(num_leaves),
        "tensors": float(schema.num_tensors),
        "flatten_us": flatten_us,
        "unflatten_us": unflatten_us,
        "round_trip_us": round_trip_us,
        "plain_round_trip_us": plain_round_trip_us,
        "torch_pytree_round_trip_us": torch_round_trip_us,
        "plain_vs_torch_pytree": plain_round_trip_us / torch_round_trip_us,
    }


if __name__ == "__main__":
    results = run()
    print(
        f"ortmodule_pytree, {int(results['leaves'])}-leaf structure "
        f"({int(results['tensors'])} tensors, 20 dataclasses), median us per call:"
    )
    print(f"  flatten                         {results['flatten_us']:8.1f}")
    print(f"  unflatten                       {results['unflatten_us']:8.1f}")
    print(f"  round trip                      {results['round_trip_us']:8.1f}")
    print(f"  round trip, dataclasses->tuples {results['plain_round_trip_us']:8.1f}")
    print(f"  torch pytree round trip, same   {results['torch_pytree_round_trip_us']:8.1f}")
    print(f"  ratio to torch pytree           {results['plain_vs_torch_pytree']:8.2f}x")
