"""The balanced partition: which rank gets which sample in one epoch, computed without comm.

Samples are ordered (shuffled, then sorted by complexity within groups), cut into blocks of
``world_size`` consecutive samples, and every block gives one sample to every rank: its most
complex sample to the rank with the least total so far, the next to the next, and so on. Every
rank therefore gets the same number of samples, and after any number of blocks the spread
between the most and least loaded rank is at most the largest spread inside one block, so at
most ``max(complexity) - min(complexity)``, whatever the order.

A few swaps between the most and least loaded ranks then narrow the spread further without
ever widening it.

Everything is a pure function of (complexities, world_size, seed, epoch, options), so every
rank computes the same table.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

__all__ = ["block_table", "epoch_rng"]


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.Generator:
    """The random stream for one (seed, epoch) pair: identical on every rank and platform."""
    return np.random.Generator(np.random.PCG64([stream, seed & 0xFFFFFFFFFFFFFFFF, epoch]))


def block_table(
    complexities: npt.NDArray[np.float64],
    world_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    random_level: float = 0.0,
    group_size: int | None = None,
) -> npt.NDArray[np.int64]:
    """A ``(num_blocks, world_size)`` table of dataset indices; column ``r`` belongs to rank r.

    Rows are blocks in order (groups in shuffled order, most complex first inside a group).
    Without ``drop_last`` the order is padded to a multiple of ``world_size`` by repeating its
    first samples, as ``torch.utils.data.DistributedSampler`` does; with it the tail is dropped.

    >>> block_table(np.array([5.0, 1.0, 4.0, 2.0]), 2, shuffle=False).tolist()
    [[0, 2], [1, 3]]
    """
    n = len(complexities)
    rng = epoch_rng(seed, epoch)
    order = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    if drop_last:
        total = (n // world_size) * world_size
        order = order[:total]
    else:
        total = math.ceil(n / world_size) * world_size
        if total > n:
            order = np.concatenate([order, np.resize(order, total - n)])
    if total == 0:
        return np.zeros((0, world_size), dtype=np.int64)
    c = complexities[order]

    if random_level > 0.0:
        # Mix each sample's complexity rank (0..1) with uniform noise: 0 keeps the strict order,
        # 1 is a random order. Balance still holds (see module docstring); per-step balance and
        # the similarity of samples that share a block degrade as the level grows.
        rank01 = np.empty(total, dtype=np.float64)
        rank01[np.argsort(c, kind="stable")] = np.arange(total) / max(total - 1, 1)
        key = (1.0 - random_level) * rank01 + random_level * rng.random(total)
    else:
        key = c
    group = total if group_size is None else math.ceil(group_size / world_size) * world_size
    group_id = np.arange(total, dtype=np.int64) // group
    # Most complex first inside each group; ties keep the (shuffled) order.
    by_key = np.lexsort((-key, group_id))
    blocks = order[by_key].reshape(-1, world_size)
    values = c[by_key].reshape(-1, world_size)
    inner = np.argsort(-values, axis=1, kind="stable")
    blocks = np.take_along_axis(blocks, inner, axis=1)
    values = np.take_along_axis(values, inner, axis=1)

    owner = _greedy_owner(values)
    table = np.empty_like(blocks)
    np.put_along_axis(table, owner, blocks, axis=1)
    placed = np.empty_like(values)
    np.put_along_axis(placed, owner, values, axis=1)
    _swap_refine(table, placed, group // world_size)
    return table


def _greedy_owner(values: npt.NDArray[np.float64]) -> npt.NDArray[np.int64]:
    """Rank receiving each block member: members (descending) go to ranks by ascending load."""
    num_blocks, world_size = values.shape
    if world_size == 1:
        return np.zeros((num_blocks, 1), dtype=np.int64)
    loads = [0.0] * world_size
    ranks = range(world_size)
    owners: list[list[int]] = []
    for row in values.tolist():
        by_load = sorted(ranks, key=loads.__getitem__)
        for r, v in zip(by_load, row, strict=True):
            loads[r] += v
        owners.append(by_load)
    return np.asarray(owners, dtype=np.int64)


def _swap_refine(
    table: npt.NDArray[np.int64], values: npt.NDArray[np.float64], rows_per_group: int
) -> None:
    """Narrow the spread left by the greedy pass, in place.

    One sample per rank per block cannot undo a long tail: the rank that took the largest
    sample can only be compensated by the spread inside later blocks. So swap a sample of the
    most loaded rank with a lighter one of the least loaded rank (from any block), choosing the
    pair that brings the two closest, a few times. Both new totals lie between the old two, so
    the spread never grows; each swapped column is then re-sorted within its groups, so samples
    at the same position on different ranks stay alike.
    """
    num_blocks, world_size = table.shape
    if world_size < 2 or num_blocks == 0:
        return
    loads = values.sum(axis=0)
    touched: set[int] = set()
    for _ in range(16 * world_size):
        hi, lo = int(np.argmax(loads)), int(np.argmin(loads))
        spread = loads[hi] - loads[lo]
        if spread <= 0:
            break
        x, y = values[:, hi], values[:, lo]
        by_y = np.argsort(y, kind="stable")
        ys = y[by_y]
        at = np.searchsorted(ys, x - spread / 2)
        best = (spread, -1, -1, 0.0)
        for cand in (at - 1, at):
            c = np.clip(cand, 0, num_blocks - 1)
            d = x - ys[c]
            after = np.where(
                (cand >= 0) & (cand < num_blocks) & (d > 0), np.abs(spread - 2 * d), np.inf
            )
            i = int(np.argmin(after))
            if after[i] < best[0]:
                best = (float(after[i]), i, int(by_y[c[i]]), float(d[i]))
        _, b_hi, b_lo, d = best
        if b_hi < 0:
            break
        table[b_hi, hi], table[b_lo, lo] = table[b_lo, lo], table[b_hi, hi]
        values[b_hi, hi], values[b_lo, lo] = values[b_lo, lo], values[b_hi, hi]
        loads[hi] -= d
        loads[lo] += d
        touched.update((hi, lo))
    segment = np.arange(num_blocks) // rows_per_group
    for r in touched:
        order = np.lexsort((-values[:, r], segment))
        table[:, r] = table[order, r]
        values[:, r] = values[order, r]
