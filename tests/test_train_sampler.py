"""DistributedSampler: disjoint shards that cover the dataset, equal counts, per-epoch order."""

from __future__ import annotations

import itertools

import pytest
import torch

from disttrain.train import DistributedSampler

SIZES = [0, 1, 7, 10, 64, 101]
WORLDS = [1, 2, 3, 4, 5]


def shards(size, world, **kwargs):
    return [list(DistributedSampler(size, world, rank, **kwargs)) for rank in range(world)]


@pytest.mark.parametrize("size,world", list(itertools.product(SIZES, WORLDS)))
@pytest.mark.parametrize("shuffle", [True, False])
def test_padded_shards_are_equal_and_cover_everything(size, world, shuffle):
    parts = shards(size, world, shuffle=shuffle, seed=3)
    counts = {len(p) for p in parts}
    assert len(counts) == 1, f"unequal shard sizes {counts}"
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(size)), "the union over ranks must be the whole dataset"
    assert len(flat) == -(-size // world) * world
    # padding repeats only what is needed: at most world-1 duplicates
    assert len(flat) - len(set(flat)) == len(flat) - size
    for rank, p in enumerate(parts):
        assert len(DistributedSampler(size, world, rank, shuffle=shuffle)) == len(p)


@pytest.mark.parametrize("size,world", [(s, w) for s, w in itertools.product(SIZES, WORLDS)
                                        if s >= w])
def test_drop_last_shards_are_disjoint_and_equal(size, world):
    parts = shards(size, world, drop_last=True, seed=1)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)), "drop_last shards must not share an index"
    assert all(len(p) == size // world for p in parts)
    assert len(set(range(size)) - set(flat)) == size % world


@pytest.mark.parametrize("size,world", list(itertools.product(SIZES, WORLDS)))
def test_uneven_shards_partition_exactly(size, world):
    parts = shards(size, world, pad=False, shuffle=True)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(size))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_epochs_reshuffle_deterministically():
    a = DistributedSampler(100, 2, 1, seed=5)
    b = DistributedSampler(100, 2, 1, seed=5)
    orders = []
    for epoch in range(3):
        a.set_epoch(epoch)
        b.set_epoch(epoch)
        assert list(a) == list(b), "same seed and epoch must give the same order"
        orders.append(list(a))
    assert orders[0] != orders[1] != orders[2], "each epoch must have its own order"
    c = DistributedSampler(100, 2, 1, seed=6)
    assert list(c) != orders[0], "the seed must change the order"


def test_strided_shards_make_global_batches():
    """Batch k of size b on N ranks holds exactly batch k of size N·b in one process."""
    size, world, b = 97, 3, 4
    single = list(DistributedSampler(size, 1, 0, seed=2, drop_last=True))
    per_rank = shards(size, world, seed=2, drop_last=True)
    for k in range(len(per_rank[0]) // b):
        union = sorted(i for p in per_rank for i in p[k * b:(k + 1) * b])
        assert union == sorted(single[k * world * b:(k + 1) * world * b])


def test_start_resumes_mid_epoch():
    sampler = DistributedSampler(50, 2, 0, seed=4)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_start(7)
    assert list(sampler) == full[7:]
    assert sampler.state_dict() == {"epoch": 2, "start": 7}
    other = DistributedSampler(50, 2, 0, seed=4)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == full[7:]


def test_padding_larger_than_dataset():
    parts = shards(2, 5, shuffle=False)  # 2 samples, 5 ranks: wraps around twice
    assert [len(p) for p in parts] == [1] * 5
    assert {i for p in parts for i in p} == {0, 1}


@pytest.mark.parametrize("kwargs,match", [
    ({"world_size": 0}, "world_size"),
    ({"world_size": 2, "rank": 2}, "rank"),
    ({"world_size": 2, "rank": -1}, "rank"),
    ({"world_size": 4, "drop_last": True}, "drop_last"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistributedSampler(3, **kwargs)
    with pytest.raises(ValueError, match="start"):
        DistributedSampler(10).set_start(11)


def test_accepts_a_dataset():
    data = torch.utils.data.TensorDataset(torch.zeros(9, 2))
    assert len(DistributedSampler(data, 2, 1)) == 5


def test_batches_walk_from_the_position_through_later_epochs():
    """What the loop's loader reads: the rest of this epoch's batches, then the next
    epoch's, each a slice of ``indices()``; the sampler's own position stays."""
    sampler = DistributedSampler(23, world_size=2, rank=1, seed=5, drop_last=True)
    sampler.load_state_dict({"epoch": 1, "start": 4})  # 11 indices per epoch, batches of 2
    walked = list(sampler.batches(2, 7))
    assert sampler.state_dict() == {"epoch": 1, "start": 4}
    epoch1 = sampler.indices()
    sampler.set_epoch(2)
    epoch2 = sampler.indices()
    want = [(1, epoch1[k:k + 2]) for k in (0, 2, 4)] + [(2, epoch2[k:k + 2]) for k in
                                                         (0, 2, 4, 6)]
    assert [e for e, _ in walked] == [e for e, _ in want]
    assert all(torch.equal(got, expected) for (_, got), (_, expected) in zip(walked, want))
    assert list(sampler.batches(2, 0)) == []
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, 11\]"):
        next(sampler.batches(12, 1))
