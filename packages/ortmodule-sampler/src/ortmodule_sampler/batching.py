"""Ready-made ``batch_fn`` for LoadBalancingDistributedBatchSampler.

>>> fixed_size_batches(2)([7, 3, 5], [9.0, 8.0, 1.0])
[[7, 3], [5]]
>>> max_complexity_batches(10)([7, 3, 5], [9.0, 8.0, 1.0])
[[7], [3, 5]]
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["fixed_size_batches", "max_complexity_batches"]


def fixed_size_batches(batch_size: int) -> Callable[[list[int], list[float]], list[list[int]]]:
    """Consecutive samples, ``batch_size`` at a time (the last batch may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")

    def batch_fn(indices: list[int], complexities: list[float]) -> list[list[int]]:
        return [indices[k : k + batch_size] for k in range(0, len(indices), batch_size)]

    return batch_fn


def max_complexity_batches(
    budget: float, *, padded: bool = False, max_batch_size: int | None = None
) -> Callable[[list[int], list[float]], list[list[int]]]:
    """Consecutive samples while the batch's cost stays within ``budget`` (a token budget).

    The cost is the sum of complexities, or with ``padded`` the batch size times its largest
    complexity (what a padded batch of sequences costs). A sample over budget on its own gets a
    batch of its own.
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0, got {budget}")
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size}")

    def batch_fn(indices: list[int], complexities: list[float]) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        total = 0.0
        largest = 0.0
        for i, c in zip(indices, complexities, strict=True):
            new_total, new_largest = total + c, max(largest, c)
            cost = new_largest * (len(current) + 1) if padded else new_total
            full = max_batch_size is not None and len(current) >= max_batch_size
            if current and (cost > budget or full):
                batches.append(current)
                current, new_total, new_largest = [], c, c
            current.append(i)
            total, largest = new_total, new_largest
        if current:
            batches.append(current)
        return batches

    return batch_fn
