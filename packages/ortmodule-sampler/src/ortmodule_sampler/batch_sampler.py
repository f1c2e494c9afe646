"""LoadBalancingDistributedBatchSampler: variable-size batches, equal step counts on every rank."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import numpy.typing as npt
from torch.utils.data import Sampler

from ortmodule_sampler.load_balancing_sampler import LoadBalancingDistributedSampler
from ortmodule_sampler.partition import epoch_rng

__all__ = ["BatchFn", "LoadBalancingDistributedBatchSampler"]

BatchFn = Callable[[list[int], list[float]], Sequence[Sequence[int]]]
"""``batch_fn(indices, complexities) -> batches``: cut one rank's samples into batches.

``indices`` are the rank's dataset indices, most complex first within a group, so consecutive
samples have similar complexity (little padding); ``complexities`` are theirs. It must be
deterministic: every rank calls it for every rank to agree on the number of steps.
"""


class LoadBalancingDistributedBatchSampler(Sampler[list[int]]):
    """Batches of a :class:`LoadBalancingDistributedSampler`, for ``DataLoader(batch_sampler=)``.

    ``batch_fn`` cuts each rank's samples into batches (fixed size, or a complexity budget such
    as a token count, see :mod:`ortmodule_sampler.batching`). Every rank ends up with the same
    number of batches, so no rank waits in a collective for one that has stopped: short ranks
    repeat their lightest batches, or with ``drop_last`` long ranks drop their last (lightest
    in block order) ones.
    Batches are then visited in an order shared by all ranks (shuffled per epoch when
    ``shuffle``), so batch k has a similar complexity on every rank.

    >>> sampler = LoadBalancingDistributedSampler(dataset, complexity_fn=len)
    >>> batch_sampler = LoadBalancingDistributedBatchSampler(sampler, batch_fn=max_complexity_batches(4096))
    >>> loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=pad)
    >>> for epoch in range(epochs):
    ...     batch_sampler.set_epoch(epoch)
    ...     train(loader)
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: BatchFn,
        drop_last: bool = False,
        shuffle: bool | None = None,
        seed: int | None = None,
    ) -> None:
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError(
                "LoadBalancingDistributedBatchSampler needs a LoadBalancingDistributedSampler, "
                f"got {type(sampler).__name__}"
            )
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last
        self.shuffle = sampler.shuffle if shuffle is None else shuffle
        self.seed = sampler.seed if seed is None else seed
        self._cache: tuple[int, list[list[list[int]]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def partition(self, epoch: int | None = None) -> list[list[list[int]]]:
        """Every rank's batches for ``epoch``, each in the order that rank iterates them."""
        epoch = self.sampler.epoch if epoch is None else epoch
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1]
        table = self.sampler.block_table(epoch)
        complexities = self.sampler.complexities
        per_rank: list[list[list[int]]] = []
        for r in range(self.sampler.world_size):
            indices = table[:, r]
            batches = self.batch_fn(indices.tolist(), complexities[indices].tolist())
            per_rank.append(_checked(batches, r))
        counts = [len(b) for b in per_rank]
        steps = min(counts) if self.drop_last else max(counts)
        per_rank = [_fit(b, steps, complexities, r) for r, b in enumerate(per_rank)]
        if self.shuffle and steps > 1:
            order = epoch_rng(self.seed, epoch, stream=2).permutation(steps).tolist()
            per_rank = [[b[i] for i in order] for b in per_rank]
        self._cache = (epoch, per_rank)
        return per_rank

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.partition()[self.sampler.rank])

    def __len__(self) -> int:
        return len(self.partition()[self.sampler.rank])


def _checked(batches: Sequence[Sequence[int]], rank: int) -> list[list[int]]:
    out = []
    for k, batch in enumerate(batches):
        b = [int(i) for i in batch]
        if not b:
            raise ValueError(f"batch_fn returned an empty batch (rank {rank}, batch {k})")
        out.append(b)
    return out


def _fit(
    batches: list[list[int]], steps: int, complexities: npt.NDArray[np.float64], rank: int
) -> list[list[int]]:
    """Exactly ``steps`` batches: drop the last ones, or repeat the lightest ones."""
    if len(batches) >= steps:
        return batches[:steps]
    if not batches:
        raise ValueError(
            f"batch_fn returned no batch for rank {rank}'s samples while another rank got "
            f"{steps}; batch_fn must return at least one batch for a non-empty list"
        )
    weight = np.array([complexities[b].sum() for b in batches])
    lightest = np.argsort(weight, kind="stable").tolist()
    extra = [batches[lightest[k % len(lightest)]] for k in range(steps - len(batches))]
    return batches + extra
