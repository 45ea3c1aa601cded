"""Hierarchical collectives: node layouts (pure), equivalence on simulated nodes, traffic per
leg, named failures, and two network-namespace "machines" launched by ``disttrain launch``.

Simulated nodes: every rank passes ``HierarchyConfig(node_id=...)``, so 2 nodes × 2 ranks run
on one host; intra-node legs still use shared memory, inter-node legs the torch transport.
Run as a module (``python -m tests.test_comm_hierarchical``) this file is the worker of the
namespace test.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from disttrain.comm import CommConfig, CommError, Communicator
from disttrain.comm.topology import (
    NODE_ID_ENV,
    HierarchyConfig,
    NodeLayout,
    gather_slots,
    group_by_key,
    node_key,
)
from tests import collective_cases, test_launch_netns
from tests.dist import COMM_TIMEOUT_S, run_fresh

two_hosts = test_launch_netns.two_hosts  # the namespace fixture: 10.213.0.1 and .2

ROOT = Path(__file__).resolve().parents[1]
Nodes = tuple[tuple[int, ...], ...]


# ---------------------------------------------------------------------------- pure
def test_group_by_key_orders_nodes_by_their_lowest_rank():
    layout = group_by_key(["b", "a", "b", "a", "c"])
    assert layout.nodes == ((0, 2), (1, 3), (4,))
    assert layout.leaders == (0, 1, 4) and layout.num_nodes == 3 and layout.world_size == 5
    assert [layout.node_of(r) for r in range(5)] == [0, 1, 0, 1, 2]
    assert [layout.local_rank(r) for r in range(5)] == [0, 0, 1, 1, 0]
    assert [layout.is_leader(r) for r in range(5)] == [True, True, False, False, True]
    assert group_by_key([b"k"] * 3).nodes == ((0, 1, 2),)
    assert group_by_key([1, 2, 3]).leaders == (0, 1, 2)


@pytest.mark.parametrize("nodes, match", [
    ((), "non-empty"), (((0,), ()), "non-empty"), (((0, 2),), "exactly once"),
    (((0, 1), (1,)), "exactly once"), (((1, 0),), "increasing"), (((1,), (0,)), "lowest rank"),
])
def test_node_layout_rejects_what_is_not_a_partition(nodes, match):
    with pytest.raises(ValueError, match=match):
        NodeLayout(nodes)
    with pytest.raises(ValueError, match="not in"):
        NodeLayout(((0,),)).node_of(3)


def test_gather_slots_pad_every_node_to_the_largest():
    assert gather_slots(NodeLayout(((0, 1), (2, 3)))) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert gather_slots(NodeLayout(((0, 2), (1, 3)))) == [(0, 0), (2, 1), (1, 2), (3, 3)]
    assert gather_slots(NodeLayout(((0,), (1, 2, 3)))) == [(0, 0), (1, 3), (2, 4), (3, 5)]


def test_node_key_precedence_explicit_then_environment_then_host():
    env = {NODE_ID_ENV: "rack7"}
    assert node_key("a", env) == node_key("a", {}) != node_key("b", {})
    assert node_key(None, env) == node_key("rack7", {})
    assert node_key(None, {}) == node_key(None, {NODE_ID_ENV: ""})  # empty: not set
    assert node_key(None, {}) != node_key("rack7", {}) and len(node_key(None, {})) == 32


def test_hierarchy_config_is_validated():
    with pytest.raises(ValueError, match="recurse"):
        HierarchyConfig(inter_algorithm="hierarchical")
    with pytest.raises(ValueError, match="intra_transport"):
        HierarchyConfig(intra_transport="pigeon")
    with pytest.raises(ValueError, match="node_id"):
        HierarchyConfig(node_id="")


# ---------------------------------------------------------------------------- on ranks
def _fresh(nodes: Nodes | None, inter_algorithm: str = "auto",
           timeout_s: float = COMM_TIMEOUT_S) -> Communicator:
    """A new communicator over the pool's ranks with its own hierarchy: rank r on node i
    of ``nodes`` (None: discovered)."""
    comm = Communicator.from_torch(config=CommConfig(timeout_s=timeout_s))
    node_id = None
    if nodes is not None:
        node_id = next(f"sim{i}" for i, node in enumerate(nodes) if comm.rank in node)
    built = comm.build_hierarchy(HierarchyConfig(node_id=node_id,
                                                  inter_algorithm=inter_algorithm))
    assert nodes is None or built.layout.nodes == nodes
    return comm


def _done(comm: Communicator) -> None:
    built = comm.hierarchy
    comm.close()  # closes the hierarchy it owns, sub-communicators first
    assert comm.hierarchy is None and built is not None
    assert all(leg is None or leg.closed for leg in (built.intra, built.inter))


def check_layout(_pool: Communicator, nodes: Nodes, op: str, reduce_op: str,
                 dtypes: list[str] | None, size_list: list[int] | None) -> list[str]:
    comm = _fresh(nodes)
    try:
        return collective_cases.check_collective(comm, op, dtypes, reduce_op, size_list,
                                                 ["hierarchical"])
    finally:
        _done(comm)


LAYOUTS: list[Nodes] = [
    ((0,), (1,)), ((0, 1),),  # inter-node only; intra-node only
    ((0, 1), (2,)), ((0, 2), (1,)),  # uneven; not consecutive
    ((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0,), (1, 2, 3)),
]


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather"])
@pytest.mark.parametrize("nodes", LAYOUTS, ids=str)
def test_matches_torch_and_the_local_reference(pools, nodes, op):
    """Every dtype and size (0, 1, 13, 1001, > 1 MiB) on simulated node layouts."""
    world_size = sum(len(node) for node in nodes)
    per_rank = pools(world_size).run(check_layout, nodes, op, "sum", None, None)
    errors = [e for rank_errors in per_rank for e in rank_errors]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("reduce_op", ["prod", "min", "max", "avg"])
def test_reduce_ops_on_two_nodes_of_two(pools, reduce_op):
    per_rank = pools(4).run(check_layout, ((0, 1), (2, 3)), "all_reduce", reduce_op,
                            ["float32", "int64", "bfloat16"], [1, 13, 1001])
    errors = [e for rank_errors in per_rank for e in rank_errors]
    assert not errors, "\n".join(errors[:20])


def on_shm_parent(_pool: Communicator, nodes: Nodes) -> list[str]:
    """The parent communicator itself on shared memory: leaders still meet over torch."""
    from disttrain.comm.transports import SharedMemoryTransport

    comm = Communicator(SharedMemoryTransport(), CommConfig(timeout_s=COMM_TIMEOUT_S))
    rank = comm.rank
    comm.build_hierarchy(HierarchyConfig(node_id=f"sim{rank in nodes[1]}"))
    errors: list[str] = []
    try:
        for op in ("all_reduce", "broadcast", "all_gather"):
            errors += collective_cases.check_collective(comm, op, ["float32", "int64"], "sum",
                                                        [0, 13, 70_001], ["hierarchical"])
        built = comm.hierarchy
        assert built is not None and built.intra is not None
        assert built.intra.transport.name == "shm" and (built.inter is not None) == built.is_leader
        assert built.inter is None or built.inter.transport.name == "torch"
        return errors
    finally:
        _done(comm)


def test_a_shared_memory_parent_works_too(pools):
    per_rank = pools(4).run(on_shm_parent, ((0, 2), (1, 3)))
    errors = [e for rank_errors in per_rank for e in rank_errors]
    assert not errors, "\n".join(errors[:20])


def same_everywhere(_pool: Communicator, nodes: Nodes) -> dict[str, Any]:
    """Odd shapes, async, float results: every rank must hold the very same bits."""
    comm = _fresh(nodes)
    try:
        gen = torch.Generator().manual_seed(comm.rank)
        x = torch.randn(7, 3, 5, generator=gen, dtype=torch.float32)
        work = comm.all_reduce(x, algorithm="hierarchical", async_op=True)
        assert work is not None
        work.wait()
        expected = sum(torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(r))
                       for r in range(comm.world_size))
        torch.testing.assert_close(x, expected, rtol=1e-5, atol=1e-5)
        digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()
        built = comm.hierarchy
        assert built is not None
        return {"digest": digest, "nodes": built.layout.nodes}
    finally:
        _done(comm)


def test_every_rank_gets_the_same_bits_and_async_works(pools):
    per_rank = pools(4).run(same_everywhere, ((0, 2), (1, 3)))
    assert len({r["digest"] for r in per_rank}) == 1


def test_one_host_is_one_node_by_default(pools):
    """Without node ids, ranks that can share memory form one node: no inter-node leg."""
    per_rank = pools(3).run(same_everywhere, None)
    assert [r["nodes"] for r in per_rank] == [((0, 1, 2),)] * 3


def ddp_on_nodes(_pool: Communicator, nodes: Nodes) -> dict[str, Any]:
    from tests.test_parallel_ddp import SMALL_CAPS, ddp_train

    comm = _fresh(nodes)
    try:  # async bucket all-reduces: the hierarchy's legs run on the progress thread
        return ddp_train(comm, "sgd", 1, {**SMALL_CAPS, "algorithm": "hierarchical"}, True)
    finally:
        _done(comm)


def test_ddp_on_hierarchical_matches_one_process(pools):
    from tests.test_parallel_ddp import BATCH, assert_replicas_match, reference_train

    results = pools(4).run(ddp_on_nodes, ((0, 1), (2, 3)))
    assert all(res["buckets"] == 3 for res in results)
    assert_replicas_match(results, reference_train("sgd", 4 * BATCH))


def traffic(_pool: Communicator, nodes: Nodes, nbytes: int) -> dict[str, Any]:
    comm = _fresh(nodes, inter_algorithm="ring")
    try:
        built = comm.hierarchy
        assert built is not None
        x = torch.full((nbytes // 4,), float(comm.rank + 1))
        comm.all_reduce(x, algorithm="hierarchical")
        p = comm.world_size
        assert bool((x == p * (p + 1) / 2).all())
        return {**built.traffic(), "leader": built.is_leader,
                "intra": None if built.intra is None else built.intra.transport.name,
                "parent_sent": comm.stats.snapshot()["all_reduce"]["bytes_sent"]}
    finally:
        _done(comm)


def test_only_leaders_cross_nodes_and_every_byte_is_counted(pools):
    nbytes = 4 * 3 * 1024
    per_rank = pools(4).run(traffic, ((0, 1), (2, 3)), nbytes)
    for rank, t in enumerate(per_rank):
        assert t["leader"] == (rank in (0, 2)) and t["intra"] == "shm", (rank, t)
        # a 2-rank ring moves 2·(1/2)·V per rank; non-leaders never touch the network
        assert t["inter_bytes_sent"] == (nbytes if t["leader"] else 0), (rank, t)
        assert t["intra_bytes_sent"] > 0, (rank, t)
        assert t["parent_sent"] == t["intra_bytes_sent"] + t["inter_bytes_sent"], (rank, t)


def _stays_out(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Rank 2 (node 1's leader) builds the hierarchy, then exits instead of reducing."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    comm = Communicator.from_torch(config=CommConfig(timeout_s=5.0))
    comm.build_hierarchy(HierarchyConfig(node_id=f"sim{rank // 2}", inter_algorithm="ring"))
    if rank == 2:
        return {"skipped": True}
    try:
        comm.all_reduce(torch.ones(1000), algorithm="hierarchical")
    except CommError as exc:
        return {"type": type(exc).__name__, "peer": getattr(exc, "peer", None),
                "message": str(exc)}
    return {"error": None}


def test_a_missing_leader_is_named_by_its_rank_in_the_parent():
    results = run_fresh(_stays_out, 4, timeout_s=90)
    assert results[2] == {"skipped": True}
    for rank in (0, 3):  # its fellow leader (network) and its node-mate (shared memory)
        assert results[rank].get("peer") == 2, (rank, results[rank])
        assert "(hierarchical)" in results[rank]["message"], results[rank]
    assert "message" in results[1], results[1]  # it waited for rank 0, which failed


# ---------------------------------------------------------------------------- two machines
NETNS_ELEMS = 1 << 20  # 4 MiB of float32 per all_reduce


def _link_tx_bytes() -> int:
    """Bytes sent on every interface but loopback of this network namespace."""
    total = 0
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, data = line.split(":", 1)
        if name.strip() != "lo":
            total += int(data.split()[8])
    return total


def _netns_worker() -> None:
    """One launched rank: hierarchical vs flat ring all_reduce, with link bytes of each."""
    import disttrain

    comm = disttrain.init()
    built = comm.build_hierarchy(HierarchyConfig(inter_algorithm="ring"))
    p = comm.world_size
    report: dict[str, Any] = {"nodes": built.layout.nodes, "leader": built.is_leader,
                              "intra": None if built.intra is None else
                              built.intra.transport.name}
    for algorithm in ("hierarchical", "ring"):
        x = torch.full((NETNS_ELEMS,), float(comm.rank + 1))
        comm.barrier()
        before = _link_tx_bytes()
        comm.barrier()  # no rank starts before every rank has read its counter
        comm.all_reduce(x, algorithm=algorithm)
        comm.barrier()  # every rank is done: nothing of this all_reduce is still to come
        report[algorithm] = {"ok": bool((x == p * (p + 1) / 2).all()),
                             "link_tx": _link_tx_bytes() - before}
    report.update(built.traffic())
    print(json.dumps(report), flush=True)
    comm.close_hierarchy()
    disttrain.shutdown(comm)


@pytest.mark.timeout(240)
def test_two_namespace_machines_with_two_ranks_each(two_hosts):
    names, _ = two_hosts
    reports = test_launch_netns.launch_on_both(
        names, "29513", ["-m", "tests.test_comm_hierarchical"], 2,
        drop_env=("GLOO_SOCKET_IFNAME", NODE_ID_ENV), cwd=ROOT)
    _check_two_machines(reports)


def _check_two_machines(reports: dict[int, dict[str, Any]]) -> None:
    assert sorted(reports) == [0, 1, 2, 3]
    volume = NETNS_ELEMS * 4
    for rank, r in reports.items():
        assert r["nodes"] == [[0, 1], [2, 3]] and r["intra"] == "shm", (rank, r)
        assert r["hierarchical"]["ok"] and r["ring"]["ok"], (rank, r)
        assert r["leader"] == (rank in (0, 2)), (rank, r)
        assert r["inter_bytes_sent"] == (volume if r["leader"] else 0), (rank, r)
    for leader in (0, 2):  # its namespace's link: what the whole machine sent
        hierarchical, ring = (reports[leader][a]["link_tx"] for a in ("hierarchical", "ring"))
        # one V per machine (plus TCP/IP headers) against the flat ring's 2·(3/4)·V
        assert volume <= hierarchical < 1.25 * volume, (leader, hierarchical, ring)
        assert ring > 1.4 * volume, (leader, hierarchical, ring)


def _time_all_reduce(sizes: list[int], iters: int) -> None:
    """Not a test: seconds per all_reduce (mean over ``iters`` between barriers, after two
    warm-up calls) of each algorithm and size, printed by rank 0 as one JSON line."""
    import time

    import disttrain

    comm = disttrain.init()
    comm.build_hierarchy(HierarchyConfig())
    seconds: dict[str, float] = {}
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4)
        for algorithm in ("hierarchical", "ring", "native"):
            for _ in range(2):
                comm.all_reduce(x, algorithm=algorithm)
            comm.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                comm.all_reduce(x, algorithm=algorithm)
            comm.barrier()
            seconds[f"{algorithm}@{nbytes}"] = (time.perf_counter() - start) / iters
    if comm.rank == 0:
        print(json.dumps({"seconds_per_all_reduce": seconds}), flush=True)
    comm.close_hierarchy()
    disttrain.shutdown(comm)


if __name__ == "__main__":  # the launched worker of the namespace test (or, with
    if len(sys.argv) > 1 and sys.argv[1] == "--time":  # --time SIZES ITERS, a measurement)
        _time_all_reduce([int(v) for v in sys.argv[2].split(",")], int(sys.argv[3]))
    else:
        _netns_worker()
