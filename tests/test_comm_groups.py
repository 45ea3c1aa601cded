"""Sub-communicators: membership, rank order from the list, collectives matching a local
reference, overlapping and nested groups, and groups running concurrently."""

from __future__ import annotations

from typing import Any

import torch

from disttrain.comm import CommConfig, Communicator


def _data(global_rank: int, n: int = 7) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) + 100 * global_rank


def _check(group: Communicator, algorithms: tuple[str, ...]) -> list[str]:
    """Collectives in ``group`` against a reference built from its members' known inputs."""
    members, r, p = group.global_ranks, group.rank, group.world_size
    inputs = [_data(g) for g in members]
    errors = []
    for algo in algorithms:
        t = inputs[r].clone()
        group.all_reduce(t, algorithm=algo)
        if not torch.equal(t, torch.stack(inputs).sum(0)):
            errors.append(f"all_reduce/{algo} in {members}")
        if algo in ("ring", "naive", "native"):
            out = torch.empty(p * 7, dtype=torch.float64)
            group.all_gather(out, inputs[r], algorithm=algo)
            if not torch.equal(out, torch.cat(inputs)):  # in the order of the list
                errors.append(f"all_gather/{algo} in {members}")
        b = inputs[r].clone()
        root = p - 1  # a group rank: global rank members[-1]
        group.broadcast(b, root, algorithm="native" if algo == "native" else "tree")
        if not torch.equal(b, inputs[root]):
            errors.append(f"broadcast/{algo} root={root} in {members}")
    return errors


def groups_of_four(comm: Communicator) -> dict[str, Any]:
    out: dict[str, Any] = {"errors": []}
    pairs = [comm.new_group([0, 1]), comm.new_group([2, 3])]  # every rank calls both
    mine = [g for g in pairs if g is not None]
    out["memberships"] = len(mine)
    (pair,) = mine
    out["pair"] = (pair.rank, pair.world_size, pair.global_ranks)
    out["errors"] += _check(pair, ("ring", "naive", "halving_doubling", "native"))
    reversed_pair = comm.new_group([3, 1])  # group rank 0 is rank 3
    out["reversed"] = None
    if reversed_pair is not None:
        out["reversed"] = (reversed_pair.rank, reversed_pair.world_size,
                           reversed_pair.global_ranks)
        out["errors"] += _check(reversed_pair, ("ring", "naive", "native"))
    trio = comm.new_group([2, 0, 3])  # overlaps both pairs
    out["trio"] = None
    if trio is not None:
        out["trio"] = (trio.rank, trio.global_ranks)
        out["errors"] += _check(trio, ("ring", "naive", "halving_doubling", "native"))
        inner = trio.new_group([2, 0])  # nested: group ranks of trio → global [3, 2]
        out["inner"] = None if inner is None else (inner.rank, inner.global_ranks)
        if inner is not None:
            out["errors"] += _check(inner, ("ring", "naive"))
    return out


def test_new_group_membership_order_and_collectives(pools):
    results = pools(4).run(groups_of_four)
    for rank, res in enumerate(results):
        assert not res["errors"], (rank, res["errors"])
        assert res["memberships"] == 1
    assert [res["pair"] for res in results] == [(0, 2, (0, 1)), (1, 2, (0, 1)),
                                                (0, 2, (2, 3)), (1, 2, (2, 3))]
    assert [res["reversed"] for res in results] == [None, (1, 2, (3, 1)), None, (0, 2, (3, 1))]
    assert [res["trio"] for res in results] == [(1, (2, 0, 3)), None, (0, (2, 0, 3)),
                                                (2, (2, 0, 3))]
    assert [res.get("inner") for res in results] == [None, None, (1, (3, 2)), (0, (3, 2))]


def concurrent_groups(comm: Communicator) -> list[str]:
    """Row and column groups of a 2×2 grid, plus the parent, all busy at once."""
    me = comm.rank
    cfg = CommConfig(timeout_s=comm.config.timeout_s, chunk_bytes=8192)
    parent = Communicator(comm.transport, cfg, owns_transport=False)
    rows = [comm.new_group([0, 1]), comm.new_group([2, 3])]
    cols = [comm.new_group([0, 2]), comm.new_group([1, 3])]
    row = next(g for g in rows if g is not None)
    col = next(g for g in cols if g is not None)
    n = 30000
    works, tensors = [], []
    for step in range(3):
        for group, tag in ((row, 1), (col, 2), (parent, 3)):
            t = torch.full((n,), float(1000 * tag + 10 * step + me))
            tensors.append((group, tag, step, t))
            works.append(group.all_reduce(t, algorithm="ring", async_op=True))
    for w in reversed(works):
        w.wait()  # type: ignore[union-attr]
    errors = []
    for group, tag, step, t in tensors:
        expected = sum(1000 * tag + 10 * step + g for g in group.global_ranks)
        if not torch.equal(t, torch.full((n,), float(expected))):
            errors.append(f"rank {me}: group {group.global_ranks} step {step} got {t[0].item()}")
    for group in (row, col, parent):
        group.close()
    return errors


def test_groups_run_concurrently_without_interference(pools):
    errors = [e for rank_errors in pools(4).run(concurrent_groups) for e in rank_errors]
    assert not errors, errors


def overlapping_groups_of_three(comm: Communicator) -> list[float]:
    """Rank 1 joins [0, 1] then [1, 2]; rank 2 only the second: their histories differ,
    which made torch name the group differently on each and wait forever."""
    results = []
    for ranks in ([0, 1], [1, 2], [2, 0], [0, 1, 2], [1, 2]):
        group = comm.new_group(ranks)
        if group is not None:
            t = torch.ones(3)
            group.all_reduce(t, algorithm="naive")
            results.append(t[0].item())
    return results


def test_overlapping_groups_with_different_histories(pools):
    results = pools(3).run(overlapping_groups_of_three, timeout_s=60)
    assert results == [[2.0, 2.0, 3.0], [2.0, 2.0, 3.0, 2.0], [2.0, 2.0, 3.0, 2.0]]
