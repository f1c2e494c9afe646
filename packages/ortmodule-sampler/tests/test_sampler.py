"""Example tests: DataLoader use, torch.distributed, options and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ortmodule_sampler import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
    fixed_size_batches,
    max_complexity_batches,
)


class Sequences(torch.utils.data.Dataset[torch.Tensor]):
    """Token sequences of given lengths; sample i is filled with i."""

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.lengths[i],), i, dtype=torch.long)


def pad(batch: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=-1)


def long_tail(n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return (rng.pareto(1.5, n) * 20 + 5).astype(int).tolist()


def test_dataloader_with_batch_size_covers_the_dataset():
    data = Sequences(long_tail(103))
    seen = []
    for rank in range(4):
        sampler = LoadBalancingDistributedSampler(data, len, world_size=4, rank=rank)
        loader = DataLoader(data, batch_size=5, sampler=sampler, collate_fn=pad)
        for batch in loader:
            seen.extend({int(v) for v in batch.unique() if v >= 0})
    assert set(seen) == set(range(103))


def test_dataloader_with_variable_length_batches():
    lengths = long_tail(200)
    data = Sequences(lengths)
    budget = 4 * max(lengths)
    steps = []
    for rank in range(3):
        sampler = LoadBalancingDistributedSampler(data, len, world_size=3, rank=rank, seed=7)
        batch_sampler = LoadBalancingDistributedBatchSampler(
            sampler, max_complexity_batches(budget, padded=True)
        )
        batch_sampler.set_epoch(2)
        loader = DataLoader(data, batch_sampler=batch_sampler, collate_fn=pad)
        shapes = [tuple(batch.shape) for batch in loader]
        assert all(rows * cols <= budget for rows, cols in shapes)
        assert len({rows for rows, _ in shapes}) > 1, "expected variable batch sizes"
        steps.append(len(shapes))
    assert len(set(steps)) == 1


def test_set_epoch_reshuffles_deterministically():
    lengths = long_tail(500)
    sampler = LoadBalancingDistributedSampler(lengths, float, world_size=4, rank=1, seed=3)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second
    assert sorted(first) != sorted(second) or first != second
    again = LoadBalancingDistributedSampler(lengths, float, world_size=4, rank=1, seed=3)
    again.set_epoch(1)
    assert list(again) == second


def test_random_level_and_group_size_vary_which_samples_share_a_step():
    lengths = list(range(1000))  # distinct: the strict order is the same every epoch

    def shared_blocks(**kwargs: float) -> int:
        s = LoadBalancingDistributedSampler(lengths, float, world_size=4, rank=0, **kwargs)
        blocks = [{frozenset(row) for row in s.block_table(epoch).tolist()} for epoch in (0, 1)]
        return len(blocks[0] & blocks[1])

    assert shared_blocks() == 250
    assert shared_blocks(random_level=1.0) < 25
    assert shared_blocks(random_level=0.5) < 125
    assert shared_blocks(group_size=64) < 25


def test_balances_better_than_distributed_sampler():
    lengths = long_tail(4000, seed=1)
    ours = LoadBalancingDistributedSampler(lengths, float, world_size=8, rank=0)
    ours_loads = [sum(lengths[i] for i in part) for part in ours.partition()]
    theirs_loads = [
        sum(lengths[i] for i in DistributedSampler(lengths, num_replicas=8, rank=r, seed=0))
        for r in range(8)
    ]
    assert max(ours_loads) - min(ours_loads) < (max(theirs_loads) - min(theirs_loads)) / 100


def straggler_ratio(per_rank_steps: list[list[int]]) -> float:
    """Sum over steps of the slowest rank's cost over the sum of the mean rank's cost."""
    steps = np.array(per_rank_steps, dtype=float)
    return float(steps.max(0).sum() / steps.mean(0).sum())


def test_steps_are_balanced_across_ranks():
    lengths = long_tail(2000, seed=2)
    world = 4
    ours = LoadBalancingDistributedSampler(lengths, float, world_size=world, rank=0)
    batches = LoadBalancingDistributedBatchSampler(ours, fixed_size_batches(10)).partition()
    batched = straggler_ratio([[sum(lengths[i] for i in b) for b in r] for r in batches])
    plain = straggler_ratio(
        [np.add.reduceat([lengths[i] for i in p], range(0, len(p), 10)) for p in ours.partition()]
    )
    theirs = [list(DistributedSampler(lengths, num_replicas=world, rank=r)) for r in range(world)]
    torch_ratio = straggler_ratio(
        [np.add.reduceat([lengths[i] for i in p], range(0, len(p), 10)) for p in theirs]
    )
    assert batched < 1.05
    assert plain < 1.2 < 1.5 < torch_ratio


def test_reads_world_from_torch_distributed():
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sampler = LoadBalancingDistributedSampler([3, 1, 2], float)
        assert (sampler.world_size, sampler.rank) == (dist.get_world_size(), dist.get_rank())
        explicit = LoadBalancingDistributedSampler([3, 1, 2], float, world_size=3, rank=2)
        assert (explicit.world_size, explicit.rank) == (3, 2)
    finally:
        if started:
            dist.destroy_process_group()


def test_without_torch_distributed_defaults_to_one_process():
    sampler = LoadBalancingDistributedSampler([3, 1, 2], float)
    assert (sampler.world_size, sampler.rank, len(sampler)) == (1, 0, 3)
    assert sorted(sampler) == [0, 1, 2]


def test_empty_dataset():
    sampler = LoadBalancingDistributedSampler([], float, world_size=2, rank=1)
    assert list(sampler) == [] and len(sampler) == 0
    assert list(LoadBalancingDistributedBatchSampler(sampler, fixed_size_batches(2))) == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 2, "rank": 2}, r"rank must be in \[0, world_size=2\)"),
        ({"world_size": 0, "rank": 0}, "world_size must be >= 1"),
        ({"random_level": 1.5}, r"random_level must be in \[0, 1\]"),
        ({"group_size": 0}, "group_size must be a positive int"),
    ],
)
def test_invalid_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoadBalancingDistributedSampler([1, 2], float, **kwargs)


def test_non_finite_complexity_names_the_sample():
    sampler = LoadBalancingDistributedSampler([1.0, float("nan")], float, world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"complexity_fn\(dataset\[1\]\) returned nan"):
        list(sampler)


def test_batch_sampler_refuses_other_samplers_and_empty_batches():
    with pytest.raises(TypeError, match="needs a LoadBalancingDistributedSampler"):
        LoadBalancingDistributedBatchSampler(DistributedSampler([1], 1, 0), fixed_size_batches(1))
    sampler = LoadBalancingDistributedSampler([1, 2], float, world_size=1, rank=0)
    bad = LoadBalancingDistributedBatchSampler(sampler, lambda idx, c: [idx, []])
    with pytest.raises(ValueError, match="empty batch"):
        list(bad)


def test_batching_helpers():
    assert fixed_size_batches(2)([7, 3, 5], [9.0, 8.0, 1.0]) == [[7, 3], [5]]
    assert max_complexity_batches(10)([7, 3, 5], [9.0, 8.0, 1.0]) == [[7], [3, 5]]
    assert max_complexity_batches(16, padded=True)([1, 2, 3], [8.0, 8.0, 1.0]) == [[1, 2], [3]]
    assert max_complexity_batches(100, max_batch_size=2)([1, 2, 3], [1.0] * 3) == [[1, 2], [3]]
    assert max_complexity_batches(1)([4], [5.0]) == [[4]]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        fixed_size_batches(0)
