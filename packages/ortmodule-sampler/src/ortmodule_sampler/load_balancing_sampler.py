"""LoadBalancingDistributedSampler: DistributedSampler whose ranks get equal total complexity."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sized
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import Sampler

from ortmodule_sampler.partition import block_table, epoch_rng

__all__ = ["LoadBalancingDistributedSampler", "resolve_world"]


class _Indexable(Sized, Protocol):
    def __getitem__(self, index: int) -> Any: ...


def resolve_world(world_size: int | None, rank: int | None) -> tuple[int, int]:
    """``world_size`` and ``rank`` as given, else from ``torch.distributed`` when initialised,
    else a single process (1, 0)."""
    if world_size is None or rank is None:
        dist = torch.distributed
        initialised = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return world_size, rank


class LoadBalancingDistributedSampler(Sampler[int]):
    """Shards a dataset across ranks so that each rank's total complexity is balanced.

    ``complexity_fn(dataset[i])`` (for example a sequence length) is evaluated once per sample.
    Each epoch every rank receives the same number of samples, as with
    ``torch.utils.data.DistributedSampler``, and the ranks' total complexities differ by at most
    ``max - min`` complexity. All ranks compute the same partition from (seed, epoch) without
    communicating. Samples at the same position on different ranks have similar complexity, so
    a ``DataLoader(batch_size=B)`` over this sampler also balances every step.

    >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len)
    >>> loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    >>> for epoch in range(epochs):
    ...     sampler.set_epoch(epoch)
    ...     train(loader)

    ``random_level`` (0..1) mixes noise into the complexity order, so that the samples sharing a
    block (and a step) change more between epochs: 0 is the strict order, 1 a random one. The
    total-complexity bound holds at every level. ``group_size`` sorts within consecutive groups
    of that many shuffled samples instead of the whole dataset, for the same purpose.
    """

    def __init__(
        self,
        dataset: _Indexable,
        complexity_fn: Callable[[Any], float],
        world_size: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0.0,
        group_size: int | None = None,
    ) -> None:
        self.world_size, self.rank = resolve_world(world_size, rank)
        if not 0.0 <= random_level <= 1.0:
            raise ValueError(f"random_level must be in [0, 1], got {random_level}")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be a positive int or None, got {group_size}")
        self.dataset = dataset
        self.complexity_fn = complexity_fn
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.random_level = float(random_level)
        self.group_size = group_size
        self.epoch = 0
        self._complexities: npt.NDArray[np.float64] | None = None
        self._table: tuple[int, npt.NDArray[np.int64]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Use the partition and order of ``epoch`` (same result on every rank)."""
        self.epoch = epoch

    @property
    def complexities(self) -> npt.NDArray[np.float64]:
        """``complexity_fn(dataset[i])`` for every i, computed on first use."""
        if self._complexities is None:
            values = np.fromiter(
                (float(self.complexity_fn(self.dataset[i])) for i in range(len(self.dataset))),
                dtype=np.float64,
                count=len(self.dataset),
            )
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                i = int(bad[0])
                raise ValueError(
                    f"complexity_fn(dataset[{i}]) returned {values[i]}; complexities must be "
                    "finite numbers (for example the sample's length)"
                )
            self._complexities = values
        return self._complexities

    @property
    def num_samples(self) -> int:
        """Samples each rank receives per epoch."""
        n = len(self.dataset)
        if self.drop_last:
            return n // self.world_size
        return math.ceil(n / self.world_size)

    def block_table(self, epoch: int | None = None) -> npt.NDArray[np.int64]:
        """``(num_samples, world_size)`` dataset indices of ``epoch``; column r is rank r's.

        Rows are in block order (most complex first within a group), before the step shuffle.
        """
        epoch = self.epoch if epoch is None else epoch
        if self._table is not None and self._table[0] == epoch:
            return self._table[1]
        table = block_table(
            self.complexities,
            self.world_size,
            seed=self.seed,
            epoch=epoch,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            random_level=self.random_level,
            group_size=self.group_size,
        )
        self._table = (epoch, table)
        return table

    def step_order(self, epoch: int | None = None) -> npt.NDArray[np.int64]:
        """The order in which every rank visits its rows of the block table (shared by all)."""
        epoch = self.epoch if epoch is None else epoch
        rows = self.num_samples
        if not self.shuffle:
            return np.arange(rows, dtype=np.int64)
        return epoch_rng(self.seed, epoch, stream=1).permutation(rows)

    def partition(self, epoch: int | None = None) -> list[list[int]]:
        """Every rank's samples for ``epoch``, each in the order that rank iterates them."""
        table = self.block_table(epoch)[self.step_order(epoch)]
        return [table[:, r].tolist() for r in range(self.world_size)]

    def __iter__(self) -> Iterator[int]:
        table = self.block_table()
        return iter(table[self.step_order(), self.rank].tolist())

    def __len__(self) -> int:
        return self.num_samples
