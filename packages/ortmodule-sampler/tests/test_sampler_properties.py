"""Property tests: coverage, determinism and the balance bound, for any data and options."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ortmodule_sampler import (
    LoadBalancingDistributedBatchSampler,
    LoadBalancingDistributedSampler,
    fixed_size_batches,
    max_complexity_batches,
)

options = st.fixed_dictionaries(
    {
        "shuffle": st.booleans(),
        "seed": st.integers(0, 2**31),
        "drop_last": st.booleans(),
        "random_level": st.sampled_from([0.0, 0.3, 1.0]),
        "group_size": st.one_of(st.none(), st.integers(1, 40)),
    }
)
complexities = st.lists(st.integers(0, 10_000), max_size=120)
worlds = st.integers(1, 9)
epochs = st.integers(0, 5)


def samplers(data: list[int], world_size: int, opts: dict) -> list[LoadBalancingDistributedSampler]:
    return [
        LoadBalancingDistributedSampler(data, float, world_size=world_size, rank=r, **opts)
        for r in range(world_size)
    ]


@settings(max_examples=150, deadline=None)
@given(complexities, worlds, options, epochs)
def test_every_sample_assigned_once_and_ranks_agree(data, world_size, opts, epoch):
    ranks = samplers(data, world_size, opts)
    for s in ranks:
        s.set_epoch(epoch)
    parts = [s.partition() for s in ranks]
    assert all(p == parts[0] for p in parts), "ranks computed different partitions"
    per_rank = [list(iter(s)) for s in ranks]
    assert per_rank == parts[0]
    n = len(data)
    expected_len = n // world_size if opts["drop_last"] else math.ceil(n / world_size)
    assert all(len(s) == expected_len == len(p) for s, p in zip(ranks, per_rank, strict=True))
    counts = Counter(i for p in per_rank for i in p)
    if opts["drop_last"]:
        assert all(c == 1 for c in counts.values())
        assert sum(counts.values()) == expected_len * world_size
    else:
        assert set(counts) == set(range(n))
        duplicates = sum(counts.values()) - n
        assert duplicates == expected_len * world_size - n
        if n % world_size == 0:
            assert all(c == 1 for c in counts.values())


@settings(max_examples=150, deadline=None)
@given(complexities, worlds, options, epochs)
def test_total_complexity_spread_is_bounded(data, world_size, opts, epoch):
    s = LoadBalancingDistributedSampler(data, float, world_size=world_size, rank=0, **opts)
    s.set_epoch(epoch)
    parts = s.partition()
    used = [data[i] for p in parts for i in p]
    if not used:
        return
    loads = [sum(data[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(used) - min(used)


@settings(max_examples=60, deadline=None)
@given(complexities, worlds, options, epochs)
def test_deterministic_across_instances_and_epochs(data, world_size, opts, epoch):
    a = LoadBalancingDistributedSampler(data, float, world_size=world_size, rank=0, **opts)
    b = LoadBalancingDistributedSampler(list(data), float, world_size=world_size, rank=0, **opts)
    a.set_epoch(epoch)
    b.set_epoch(epoch + 1)
    first = a.partition()
    b.set_epoch(epoch)
    assert b.partition() == first
    a.set_epoch(epoch + 1)
    a.set_epoch(epoch)
    assert a.partition() == first


@settings(max_examples=100, deadline=None)
@given(
    complexities,
    worlds,
    options,
    epochs,
    st.one_of(
        st.integers(1, 7).map(fixed_size_batches),
        st.integers(1, 30_000).map(max_complexity_batches),
        st.integers(1, 30_000).map(lambda b: max_complexity_batches(b, padded=True)),
    ),
)
def test_batch_sampler_equal_steps_and_coverage(data, world_size, opts, epoch, batch_fn):
    batch_drop_last = opts["drop_last"]
    ranks = [
        LoadBalancingDistributedBatchSampler(s, batch_fn, drop_last=batch_drop_last)
        for s in samplers(data, world_size, opts)
    ]
    for b in ranks:
        b.set_epoch(epoch)
    batches = [list(iter(b)) for b in ranks]
    assert len({len(b) for b in batches}) == 1, "ranks would run different numbers of steps"
    assert all(len(b) == len(r) for b, r in zip(batches, ranks, strict=True))
    for rank_batches, s in zip(batches, ranks, strict=True):
        own = set(s.sampler.partition()[s.sampler.rank])
        assert all(batch and set(batch) <= own for batch in rank_batches)
    if not batch_drop_last and not opts["drop_last"]:
        seen = {i for b in batches for batch in b for i in batch}
        assert seen == set(range(len(data)))


def test_bound_is_tight_enough_on_a_long_tail():
    rng = np.random.default_rng(0)
    lengths = (rng.pareto(1.5, 5000) * 50 + 10).astype(int).tolist()
    s = LoadBalancingDistributedSampler(lengths, float, world_size=8, rank=0)
    loads = [sum(lengths[i] for i in p) for p in s.partition()]
    assert max(loads) / (sum(loads) / len(loads)) < 1.001
