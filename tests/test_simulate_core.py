"""disttrain.simulate building blocks, pure: the event engine, collectives against their
closed forms, the ZeRO paper's memory table, cluster files and worker-speed sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from disttrain.comm.cost_model import LinkCosts, predict
from disttrain.simulate.cluster import Cluster, Link, from_dict, get_cluster, load_toml
from disttrain.simulate.collectives import (
    Group,
    collective_time,
    ring_all_reduce_tasks,
    thakur_ring,
    tree_all_reduce_tasks,
    unstreamed,
)
from disttrain.simulate.events import Simulation
from disttrain.simulate.memory import zero_paper_table
from disttrain.simulate.workload import Speeds, Workload

COSTS = LinkCosts(alpha=3e-5, beta=1 / 2e9, gamma=1 / 5e9, chunk_bytes=1 << 20)


# ---------------------------------------------------------------------------- events
def test_fifo_resource_runs_in_order_and_waits_for_dependencies() -> None:
    sim = Simulation()
    a = sim.add("a", "cpu", 2.0)
    b = sim.add("b", "link", 1.0, (a,))
    c = sim.add("c", "cpu", 1.0)  # behind a on the same stream
    d = sim.add("d", "link", 0.5)  # behind b: fifo holds it although it is ready at 0
    assert sim.run() == 3.5
    assert (sim.start(c), sim.end(c)) == (2.0, 3.0)
    assert (sim.start(b), sim.start(d)) == (2.0, 3.0)
    assert sim.busy("cpu") == 3.0


def test_ready_resource_serves_the_first_ready_task() -> None:
    sim = Simulation()
    sim.resource("server", "ready")
    slow = sim.add("slow", "w0", 5.0)
    fast = sim.add("fast", "w1", 1.0)
    late = sim.add("late", "server", 1.0, (slow,))  # added first, ready at 5
    early = sim.add("early", "server", 1.0, (fast,))  # ready at 1: served first
    sim.run()
    assert sim.start(early) == 1.0 and sim.start(late) == 5.0


def test_bad_tasks_are_rejected_with_the_reason() -> None:
    sim = Simulation()
    with pytest.raises(ValueError, match="unknown task id"):
        sim.add("x", "cpu", 1.0, (3,))
    with pytest.raises(ValueError, match="duration"):
        sim.add("x", "cpu", -1.0)
    with pytest.raises(ValueError, match="policy"):
        sim.resource("r", "lifo")


# ---------------------------------------------------------------------------- collectives
@pytest.mark.parametrize("p", [2, 3, 4, 7, 64])
def test_simulated_ring_all_reduce_is_thakurs_closed_form(p: int) -> None:
    n = 10_000_000.0
    sim = Simulation()
    ring_all_reduce_tasks(sim, "link", "cpu", p, n, COSTS)
    expected = thakur_ring(p, n, COSTS.alpha, COSTS.beta, COSTS.gamma)
    assert sim.run() == pytest.approx(expected, rel=1e-12)
    # and the cost model's ring, with nothing streamed, is the same formula
    assert predict("all_reduce", "ring", p, int(n), unstreamed(COSTS)) == pytest.approx(
        thakur_ring(p, int(n), COSTS.alpha, COSTS.beta, COSTS.gamma), rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 5, 16])
def test_simulated_tree_all_reduce_is_the_binomial_closed_form(p: int) -> None:
    n = 1_000_000.0
    sim = Simulation()
    tree_all_reduce_tasks(sim, "link", "cpu", p, n, COSTS)
    lg = math.ceil(math.log2(p))
    expected = 2 * lg * (COSTS.alpha + n * COSTS.beta) + lg * n * COSTS.gamma
    assert sim.run() == pytest.approx(expected, rel=1e-12)
    assert predict("all_reduce", "tree", p, int(n), COSTS) == pytest.approx(expected)


def _two_level(nodes: int = 4, per_node: int = 8) -> Cluster:
    return Cluster("t", nodes, per_node, 80e9, Link(5e-6, 300e9), Link(1e-5, 50e9),
                   device_flops=1e14, gamma=1e-12)


def test_hierarchical_is_intra_reduce_scatter_inter_ring_intra_all_gather() -> None:
    cluster, n = _two_level(), 1e8
    seconds, name = collective_time(cluster, "all_reduce", "hierarchical", Group(32, 8), n)
    intra, inter = cluster.intra_link(), cluster.inter_link(8)
    expected = (predict("reduce_scatter", "ring", 8, int(n), intra)
                + predict("all_reduce", "ring", 4, int(n / 8), inter)
                + predict("all_gather", "ring", 8, int(n), intra))
    assert name == "hierarchical" and seconds == pytest.approx(expected)


def test_auto_picks_the_fastest_and_a_flat_ring_runs_at_the_nic() -> None:
    cluster, n = _two_level(), 1e8
    auto, _ = collective_time(cluster, "all_reduce", "auto", Group(32, 8), n)
    each = [collective_time(cluster, "all_reduce", a, Group(32, 8), n)[0]
            for a in ("ring", "tree", "halving_doubling", "hierarchical")]
    assert auto == min(each)
    ring, _ = collective_time(cluster, "all_reduce", "ring", Group(32, 8), n)
    assert ring == pytest.approx(thakur_ring(32, n, 1e-5, 1 / 50e9, 1e-12), rel=1e-3)
    inside, _ = collective_time(cluster, "all_reduce", "ring", Group(8, 8), n)
    assert inside < ring  # NVLink only


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather"])
@pytest.mark.parametrize("group", [Group(8, 8), Group(32, 8), Group(24, 8)])
def test_tree_without_a_tree_is_the_fastest_algorithm_the_op_has(op: str, group: Group
                                                                  ) -> None:
    cluster, n = _two_level(), 1e8
    each = {a: collective_time(cluster, op, a, group, n) for a in ("ring", "halving_doubling")}
    assert collective_time(cluster, op, "tree", group, n) == min(each.values())
    assert collective_time(cluster, op, "hierarchical", group, n) == each["ring"]


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_halving_doubling_folds_neighbours_on_their_node(op: str) -> None:
    # p = 24 folds 8 pairs (2v, 2v+1) onto q = 16: the same steps as p = 16 plus the fold
    cluster, n = _two_level(nodes=8), 1e8
    small = n / 24

    def fold(per_node: int) -> float:
        t24, _ = collective_time(cluster, op, "halving_doubling", Group(24, per_node), n)
        t16, _ = collective_time(cluster, op, "halving_doubling", Group(16, per_node), n)
        return t24 - t16

    def expected(c: LinkCosts) -> float:
        a, b, g = c.alpha, c.beta, cluster.intra_link().gamma
        return {"all_reduce": 2 * (a + n * b) + n * g,
                "reduce_scatter": 2 * a + (n + small) * b + n * g,
                "all_gather": 2 * a + (small + n) * b}[op]

    # 8 per node: every pair on one node; 3 per node: pair (2, 3) spans nodes 0 and 1
    assert fold(8) == pytest.approx(expected(cluster.intra_link()))
    assert fold(3) == pytest.approx(expected(cluster.inter_link()))
    assert fold(8) < fold(3)


# ---------------------------------------------------------------------------- memory
def test_zero_paper_memory_table() -> None:
    table = zero_paper_table(psi=7_500_000_000, devices=64, k_bytes=12)
    assert {k: round(v, 1) for k, v in table.items()} == {
        "ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


# ---------------------------------------------------------------------------- clusters
GOOD = """
name = "mine"
nodes = 16
devices_per_node = 8
device_tflops = 150
device_memory_gb = 80
[intra]
bandwidth_gbps = 2400
latency_us = 5
[inter]
bandwidth_gbps = 400
latency_us = 10
"""


def test_cluster_toml_parses(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(GOOD)
    cluster = get_cluster(str(path))
    assert (cluster.name, cluster.devices, cluster.device_flops) == ("mine", 128, 150e12)
    assert cluster.inter.bandwidth == pytest.approx(50e9)
    assert cluster.intra.latency_s == pytest.approx(5e-6)
    assert cluster.device_memory == 80e9


@pytest.mark.parametrize(("old", "new", "field"), [
    ("nodes = 16", "", "nodes"),
    ("nodes = 16", "nodes = 0", "nodes"),
    ("nodes = 16", "nodes = 2.5", "nodes"),
    ("device_tflops = 150", "", "device_tflops"),
    ("device_memory_gb = 80", "device_memory_gb = -80", "device_memory_gb"),
    ("bandwidth_gbps = 400", "bandwidth_gbps = -1", "bandwidth_gbps"),
    ("latency_us = 10", "", "latency_us"),
    ("[inter]", "[inter2]", "inter"),
])
def test_cluster_toml_errors_name_the_field(tmp_path: Path, old: str, new: str,
                                            field: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(GOOD.replace(old, new))
    with pytest.raises(ValueError, match=field):
        load_toml(path)


def test_cluster_file_rejects_unknown_keys_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gpus"):
        from_dict({"gpus": 8})
    path = tmp_path / "bad.toml"
    path.write_text("nodes = [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_toml(path)
    with pytest.raises(ValueError, match="unknown cluster"):
        get_cluster("no-such-preset")


def test_presets_are_valid_and_grow_when_asked() -> None:
    for name in ("nvlink-node", "cluster-400g", "roce-25g", "local"):
        assert get_cluster(name).devices >= 1
    big = get_cluster("cluster-400g").fitted(4096)
    assert big.nodes == 512


def test_local_reads_the_calibration_of_the_chosen_transport(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from disttrain.comm.cost_model import LinkCosts, save_costs

    path = tmp_path / "calibration.json"
    monkeypatch.setenv("DISTTRAIN_CALIBRATION", str(path))
    save_costs("torch", LinkCosts(alpha=7e-4, beta=1e-9, source="torch run"), path)
    save_costs("shm", LinkCosts(alpha=3e-6, beta=1e-10, source="shm run"), path)
    gloo, shm = get_cluster("local"), get_cluster("local", "shm")
    assert (gloo.intra.latency_s, shm.intra.latency_s) == (7e-4, 3e-6)
    assert "shm transport" in shm.description and "shm run" in shm.description
    with pytest.raises(ValueError, match="--cluster local only"):
        get_cluster("roce-25g", "shm")


# ---------------------------------------------------------------------------- workload
@pytest.mark.parametrize("workers", [1, 8, 31, 32, 33, 4096])
@pytest.mark.parametrize("spec", ["none", "lognormal:0.2", "straggler:0.01:3"])
def test_representatives_weigh_every_worker(workers: int, spec: str) -> None:
    speeds = Speeds.parse(spec)
    reps = speeds.representatives(workers)
    assert len(reps) <= 32
    assert sum(w for _, w in reps) == pytest.approx(workers)
    assert max(f for f, _ in reps) == pytest.approx(speeds.slowest(workers))


def test_workload_and_speed_errors_say_the_fix() -> None:
    with pytest.raises(ValueError, match="lognormal:SIGMA"):
        Speeds.parse("gauss:1")
    with pytest.raises(ValueError, match="precision"):
        Workload(precision="fp8")
    with pytest.raises(ValueError, match="batch_per_worker"):
        Workload(batch_per_worker=0)
