"""The mesh of named dimensions (dp_replicate, dp_shard, pp, cp, ep, tp): rank ↔ coordinates
and group membership as pure data, and the sub-communicators it builds on real ranks."""

from __future__ import annotations

import pytest
import torch

from disttrain.parallel.mesh import DIMS, MeshShape, build_mesh


def _dpt(shape: MeshShape, rank: int) -> tuple[int, int, int]:
    c = shape.coords(rank)
    return c.dp_rank, c.pp_rank, c.tp_rank


def test_tp_is_innermost_then_pp_then_dp():
    shape = MeshShape(dp=2, pp=2, tp=2)
    assert [_dpt(shape, r) for r in (0, 1, 2, 5, 7)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 1), (1, 1, 1)]
    assert all(shape.rank_of(*_dpt(shape, r)) == r for r in range(8))


def test_every_named_dimension_has_its_place_and_dp_takes_both_data_parallel_ones():
    shape = MeshShape(dp_replicate=2, dp_shard=2, cp=2, tp=2)  # 16 ranks
    assert DIMS == ("dp_replicate", "dp_shard", "pp", "cp", "ep", "tp")
    assert shape.world_size == 16 and shape.size("dp") == 4 and shape.size(("cp", "tp")) == 4
    c = shape.coords(13)  # 13 = ((1·2 + 1)·2 + 0)·2 + 1
    assert c.at == {"dp_replicate": 1, "dp_shard": 1, "pp": 0, "cp": 0, "ep": 0, "tp": 1}
    assert (c.dp_rank, c["dp_shard"], c.cp_rank, c.tp_rank) == (3, 1, 0, 1)
    assert shape.groups("dp_shard")[0] == (0, 4)  # shards inside a replica
    assert shape.groups("dp_replicate")[0] == (0, 8)  # the replicas of one shard
    assert shape.groups("dp")[0] == (0, 4, 8, 12)  # every data-parallel rank, dp_rank order
    assert shape.group_of(13, ("dp_shard", "cp")) == (9, 11, 13, 15)
    assert MeshShape(dp_replicate=2, dp_shard=2) != MeshShape(dp=4)
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        shape.size("xp")


def test_groups_of_each_dimension():
    shape = MeshShape(dp=2, pp=2, tp=2)
    assert shape.groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shape.groups("pp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert shape.groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert shape.group_of(5, "dp") == (1, 5)


def test_with_tp_1_the_mesh_is_the_pipelines_order():
    """Rank r is stage r % pp of replica r // pp, as pipelines always laid ranks out."""
    shape = MeshShape(dp=3, pp=2)
    for r in range(6):
        assert (shape.coords(r).pp_rank, shape.coords(r).dp_rank) == (r % 2, r // 2)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12])
def test_every_group_partitions_the_ranks(world):
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0):
            shape = MeshShape.infer(world, tp=tp, pp=pp)
            for dim in ("dp", "pp", "tp"):
                groups = shape.groups(dim)
                assert sorted(r for g in groups for r in g) == list(range(world))
                assert all(len(g) == shape.size(dim) for g in groups)
                assert all([getattr(shape.coords(r), f"{dim}_rank") for r in g]
                           == list(range(len(g))) for g in groups)


def test_infer_fills_dp_and_names_the_fix():
    assert MeshShape.infer(8, tp=2) == MeshShape(dp=4, pp=1, tp=2)
    assert MeshShape.infer(8, dp=2, tp=2, pp=2) == MeshShape(2, 2, 2)
    with pytest.raises(ValueError, match="--dp 2 × --pp 1 × --tp 2 = 4 ranks, but the world "
                                         "has 8"):
        MeshShape.infer(8, dp=2, tp=2)
    with pytest.raises(ValueError, match="--pp 1 × --tp 3 = 3 does not divide the world size 8"):
        MeshShape.infer(8, tp=3)
    with pytest.raises(ValueError, match="--pp must be an int ≥ 1"):
        MeshShape.infer(8, pp=0)
    with pytest.raises(ValueError, match="tp=0"):
        MeshShape(tp=0)
    with pytest.raises(ValueError, match=r"rank 4 is not in 0\.\.3"):
        MeshShape(dp=2, tp=2).coords(4)


# ---------------------------------------------------------------- on real ranks
def mesh_groups(comm, dp: int, pp: int, tp: int) -> dict:
    mesh = build_mesh(comm.new_group(list(range(comm.world_size))), MeshShape(dp, pp, tp))
    out = {}
    for dim in ("dp", "pp", "tp"):
        sub = getattr(mesh, dim)
        if sub is None:
            out[dim] = None
            continue
        value = torch.tensor([float(comm.rank)])
        sub.all_reduce(value)  # the group works, and holds who it should
        out[dim] = (sub.global_ranks, sub.rank, float(value))
    out["coords"] = (mesh.dp_rank, mesh.pp_rank, mesh.tp_rank)
    return out


def test_build_mesh_makes_the_groups_of_each_rank(pools):
    results = pools(4).run(mesh_groups, 1, 2, 2)
    shape = MeshShape(1, 2, 2)
    for rank, got in enumerate(results):
        assert got["dp"] is None  # size 1: no communicator
        for dim in ("pp", "tp"):
            ranks, group_rank, total = got[dim]
            assert ranks == shape.group_of(rank, dim)
            assert group_rank == ranks.index(rank) and total == sum(ranks)
        assert got["coords"] == _dpt(shape, rank)


def disagreeing_mesh(comm) -> str:
    tp = 2 if comm.rank == 0 else 1
    try:
        build_mesh(comm, MeshShape(dp=2 // tp, tp=tp))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_about_the_shape_fail_together(pools):
    for message in pools(2).run(disagreeing_mesh):
        assert message.startswith("the ranks disagree about the mesh shape (dp_replicate, "
                                  "dp_shard, pp, cp, ep, tp) (rank 0: [1, 1, 1, 1, 1, 2]; "
                                  "rank 1: [2, 1, 1, 1, 1, 1])")


def hybrid_groups(comm) -> dict:
    shape = MeshShape(dp_replicate=2, dp_shard=2)
    mesh = build_mesh(comm.new_group(list(range(comm.world_size))), shape)
    out = {}
    for dims in ("dp_shard", "dp_replicate", "dp"):
        sub = mesh.group(dims)
        out[dims] = (sub.global_ranks, sub.rank, mesh.coord(dims), mesh.size(dims))
    return out


def test_a_hybrid_mesh_has_shard_replicate_and_combined_groups(pools):
    for rank, got in enumerate(pools(4).run(hybrid_groups)):
        shape = MeshShape(dp_replicate=2, dp_shard=2)
        for dims, (ranks, group_rank, coord, size) in got.items():
            assert tuple(ranks) == shape.group_of(rank, dims) and len(ranks) == size
            assert group_rank == coord  # group rank i has coordinate i along the dims
        assert tuple(got["dp"][0]) == (0, 1, 2, 3)
