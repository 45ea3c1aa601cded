"""The pure shard maps: layouts, resharding read plans, buckets, memory formulas (no ranks)."""

from __future__ import annotations

import itertools

import pytest
import torch

from disttrain.parallel.zero import formula, read_plan, shard_layout
from disttrain.parallel.zero.sharding import ZeroConfig, partition

CASES = [(7,), (6, 2, 3), (1, 1, 1, 1, 1), (5, 0, 9, 0), (100, 3), (2,)]


def materialize(numels, layout, rank):
    """Rebuild a rank's shard from its pieces, with params holding their flat indices."""
    offsets = layout.offsets()
    shard = [-1] * layout.shard_size
    for pc in layout.pieces[rank]:
        for k in range(pc.length):
            shard[pc.shard_offset + k] = offsets[pc.param] + pc.param_offset + k
    return shard


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numels", CASES)
def test_layout_is_contiguous_equal_and_padded(numels, world_size):
    layout = shard_layout(numels, world_size)
    total = sum(numels)
    assert layout.shard_size == -(-total // world_size)
    assert layout.padded_total == layout.shard_size * world_size >= total
    assert layout.padding == layout.padded_total - total < world_size
    flat = [i for r in range(world_size) for i in materialize(numels, layout, r)]
    # concatenating the shards gives the flat vector, then only padding (-1)
    assert flat[:total] == list(range(total))
    assert flat[total:] == [-1] * layout.padding
    for r in range(world_size):
        assert layout.real_length(r) == sum(pc.length for pc in layout.pieces[r])
        for pc in layout.pieces[r]:
            assert pc.length > 0 and pc.param_offset + pc.length <= numels[pc.param]


def test_documented_example():
    layout = shard_layout([6, 2, 3], 3)
    assert layout.shard_size == 4
    assert [(p.param, p.param_offset, p.shard_offset, p.length) for p in layout.pieces[1]] == [
        (0, 4, 0, 2), (1, 0, 2, 2)]
    assert layout.real_length(2) == 3 and layout.padding == 1


@pytest.mark.parametrize("bad", [([], 2), ([0, 0], 2), ([3], 0), ([-1, 4], 2), ([2.0], 2)])
def test_layout_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        shard_layout(*bad)


def _shards(values, layout):
    flat = torch.cat([values, torch.zeros(layout.padding)])
    return list(flat.split(layout.shard_size))


@pytest.mark.parametrize("old_n,new_n", list(itertools.permutations([1, 2, 3, 4], 2)))
def test_read_plan_reshards_any_world_size(old_n, new_n):
    """Regroup too: the old run had one group, the new one two (as stage 1 → stage 2)."""
    numels = [13, 4, 0, 9, 1]
    values = torch.arange(1.0, sum(numels) + 1)
    old = shard_layout(numels, old_n)
    old_shards = _shards(values, old)
    groups = [[3, 4], [0, 1, 2]]  # new groups, listing old parameter indices
    offsets = old.offsets()
    for group in groups:
        new = shard_layout([numels[i] for i in group], new_n)
        expected = torch.cat([values[offsets[i]:offsets[i] + numels[i]] for i in group])
        expected_shards = _shards(expected, new)
        where = [(0, i) for i in group]
        for rank in range(new_n):
            got = torch.zeros(new.shard_size)
            reads = read_plan([old], where, new, rank)
            for rd in reads:
                got[rd.dst_offset:rd.dst_offset + rd.length] = (
                    old_shards[rd.src_rank][rd.src_offset:rd.src_offset + rd.length])
            assert torch.equal(got, expected_shards[rank])


def test_read_plan_merges_adjacent_reads():
    old, new = shard_layout([4, 4, 4, 4], 2), shard_layout([4, 4, 4, 4], 4)
    reads = read_plan([old], [(0, i) for i in range(4)], new, 1)
    assert len(reads) == 1 and (reads[0].src_rank, reads[0].src_offset, reads[0].length) == (
        0, 4, 4)


def test_read_plan_rejects_shape_change():
    with pytest.raises(ValueError, match="elements"):
        read_plan([shard_layout([4, 5], 2)], [(0, 0), (0, 1)], shard_layout([4, 6], 2), 0)


def test_partition_into_buckets():
    assert partition([4, 4, 4, 4, 4], 8) == [[0, 1], [2, 3], [4]]
    assert partition([100, 1, 1], 8) == [[0], [1, 2]]
    with pytest.raises(ValueError):
        partition([1], 0)


def test_formula_matches_the_paper():
    psi, n = 1_000_000, 4
    mixed = dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    assert formula("ddp", psi, n, **mixed).total == 16 * psi
    assert formula("zero1", psi, n, **mixed).total == 4 * psi + 12 * psi // n
    assert formula("zero2", psi, n, **mixed).total == 2 * psi + 14 * psi // n
    assert formula("zero3", psi, n, **mixed).total == 16 * psi // n
    fp32 = dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8)
    assert formula("zero1", psi, n, **fp32).total == 8 * psi + 8 * psi // n
    assert formula("zero2", psi, n, **fp32).total == 4 * psi + 12 * psi // n
    with pytest.raises(ValueError, match="stage must be 0-3"):
        formula("zero4", psi, n, **fp32)


def test_config_validation():
    with pytest.raises(ValueError, match="bucket_bytes"):
        ZeroConfig(bucket_bytes=0)
    with pytest.raises(ValueError, match="master_dtype"):
        ZeroConfig(master_dtype=torch.int64)
    for bad in ("rnig", "tree", 3):  # tree has no all-gather or reduce-scatter
        with pytest.raises(ValueError, match=r"algorithm=.*choose None .*'auto' or one of: "
                                             r"naive, ring"):
            ZeroConfig(algorithm=bad)  # type: ignore[arg-type]
    for name in ("prefetch", "broadcast_from_rank0"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 'no'"):
            ZeroConfig(**{name: "no"})  # type: ignore[arg-type]


def test_config_algorithm_per_collective():
    """``ring`` has no broadcast: the wrap-time broadcast falls back to the default."""
    ring = ZeroConfig(algorithm="ring")
    assert ring.algorithm_for("reduce_scatter") == "ring"
    assert ring.algorithm_for("broadcast") is None
    assert ZeroConfig(algorithm="naive").algorithm_for("broadcast") == "naive"
    assert ZeroConfig(algorithm="auto").algorithm_for("broadcast") == "auto"
    assert ZeroConfig().algorithm_for("all_gather") is None


def test_stage3_units_default_custom_and_tied():
    from torch import nn

    from disttrain.parallel.zero.sharding import trainable
    from disttrain.parallel.zero.stage3 import assign_units
    from tests.zero_cases import Net

    net = Net()
    named = trainable(net)
    names = [n for n, _ in named]
    default = [(m, [names[i] for i in idx]) for m, idx in assign_units(net, named, None)]
    assert [ns for _, ns in default] == [
        ["scale"], ["body.0.weight", "body.0.bias"], ["body.2.weight", "body.2.bias"],
        ["body.3.weight", "body.3.bias"], ["head.weight", "head.bias"]]
    assert default[0][0] is net  # the root holds parameters no unit claims
    custom = assign_units(net, named, [net.body, net.body[3]])
    assert [[names[i] for i in idx] for _, idx in custom] == [
        ["scale", "head.weight", "head.bias"],
        ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"],
        ["body.3.weight", "body.3.bias"]]
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(10, 2))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied weights"):
        assign_units(tied, trainable(tied), [tied[0], tied[1]])
    assign_units(tied, trainable(tied), [tied])  # one unit holding both users is fine
    by_default = assign_units(tied, trainable(tied), None)  # the tie's users: the root's
    assert [(m, len(idx)) for m, idx in by_default] == [(tied, 1), (tied[2], 2)]
