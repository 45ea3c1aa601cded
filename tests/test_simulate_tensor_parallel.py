"""Tensor parallelism in ``disttrain simulate``: its cost functions as pure functions, every
collective on the critical path, and a recommendation of TP inside a node with data
parallelism across nodes where that pays (and not where it does not)."""

from __future__ import annotations

import pytest

from disttrain.cli import main
from disttrain.comm.cost_model import LinkCosts, predict
from disttrain.parallel.tensor.theory import LMShape, tp_collectives
from disttrain.simulate.analytic import GPT_SHAPES, gpt
from disttrain.simulate.base import Case
from disttrain.simulate.cluster import Cluster, Link, get_cluster
from disttrain.simulate.recommend import recommend
from disttrain.simulate.strategies import simulate, sweep
from disttrain.simulate.tensor_parallel import (
    activation_ratio,
    layer_collectives,
    simulate_tp,
    split_error,
    tp_size_for,
)
from disttrain.simulate.workload import Workload

SMALL = LMShape(vocab_size=96, d_model=64, n_heads=8, n_layers=2, max_len=32)


def test_tp_size_stays_in_a_node_and_divides_everything():
    assert tp_size_for(GPT_SHAPES["gpt-13b"], 64, 8, False) == 8  # 40 heads, 8 per node
    assert tp_size_for(SMALL, 12, 8, False) == 4  # 12 workers: 8 and 6 do not divide them
    assert tp_size_for(LMShape(96, 60, 6, 2, 32), 8, 8, False) == 2  # 6 heads
    assert tp_size_for(LMShape(96, 64, 8, 2, 30), 8, 8, True) == 2  # SP: 30 tokens
    assert split_error(SMALL, 3, False) == "n_heads=8 does not divide by tp 3"
    assert split_error(SMALL, 4, False) is None


def test_layer_collectives_are_the_whole_step_split_by_layer():
    per_layer = layer_collectives(SMALL, 4, 4, True, 2)
    assert len(per_layer) == SMALL.n_layers + 3
    whole = tp_collectives(SMALL, 4, SMALL.max_len, 4, True, 2)
    flat = [c for fwd, bwd in per_layer for c in (*fwd, *bwd)]
    assert sorted(flat, key=repr) == sorted(whole, key=repr)
    assert all("backward" not in c.where for fwd, _ in per_layer for c in fwd)


def _free_compute_case(workers: int, costs: LinkCosts, per_node: int = 8) -> Case:
    """A GPT whose compute takes no time (an infinitely fast device), on nodes of
    ``per_node`` devices whose links cost ``costs``."""
    profile = gpt(SMALL, "toy", device_flops=1e300)
    cluster = Cluster("toy", 4, per_node, 1e12, Link(1.0, 1.0), Link(1.0, 1.0), gamma=1.0,
                      intra_costs=costs)
    return Case(profile, cluster, Workload(global_batch=8, algorithm="ring"), workers)


def test_every_collective_is_on_the_critical_path():
    """With free compute the step is the sum of the TP collectives' times, in sequence, and
    the optimizer on a quarter of the parameters."""
    costs = LinkCosts(alpha=1e-5, beta=1e-9, gamma=1e-10)
    case = _free_compute_case(4, costs)
    row = simulate_tp(case, "tp")
    comm = sum(predict(c.op, "ring", 4, c.numel * c.element_size, costs)
               for c in tp_collectives(SMALL, 8, SMALL.max_len, 4, False, 4))
    optimizer = case.optimizer(case.profile.params / 4, case.profile.tensors)
    assert row.error is None and 0 < optimizer < comm / 100
    assert row.step_s == pytest.approx(comm + optimizer, rel=1e-9)
    assert row.details["exposed_comm_s"] == pytest.approx(comm, rel=1e-6)


def test_sequence_parallelism_costs_the_same_time_and_less_memory():
    costs = LinkCosts(alpha=1e-5, beta=1e-9, gamma=0.0)
    tp, sp = (simulate_tp(_free_compute_case(4, costs), s) for s in ("tp", "tp-sp"))
    assert sp.memory_bytes < tp.memory_bytes
    assert activation_ratio(SMALL, 4, True) < activation_ratio(SMALL, 4, False) < 1
    assert activation_ratio(SMALL, 1, False) == 1


def test_a_model_without_heads_cannot_be_split():
    from disttrain.simulate.analytic import resnet101

    case = Case(resnet101(1e13), get_cluster("nvlink-node"), Workload(), 8)
    row = simulate_tp(case, "tp")
    assert row.error is not None and "is not one (use --model transformer" in row.error
    big = Case(gpt(SMALL, "toy", 1e13), get_cluster("cluster-400g"), Workload(), 16)
    assert "n_heads=8 does not divide by tp 16" in simulate_tp(big, "tp").error


def test_tp_across_nodes_loses_to_tp_inside_a_node_with_dp_across():
    cluster, wl = get_cluster("cluster-400g"), Workload(batch_per_worker=1, precision="bf16")
    profile = gpt(GPT_SHAPES["gpt-1.3b"], "gpt-1.3b", cluster.device_flops or 1.0)
    across = simulate(profile, cluster, wl, "tp", 16)  # 16 heads over 2 nodes
    inside = simulate(profile, cluster, wl, "3d", 16)
    assert across.details["tp_size"] == 16 and inside.details["tp_size"] == 8
    assert inside.details["dp_size"] == 2 and "tp 8 inside a node × dp 2" in inside.notes[0]
    assert inside.step_s < across.step_s


def test_recommendation_puts_tp_inside_nodes_when_it_pays():
    """A 13B GPT does not fit data-parallel; tp 8 on each node's fabric and dp across the
    nodes is the fastest that fits. A 1.3B GPT is better off data-parallel."""
    cluster = get_cluster("cluster-400g")
    wl = Workload(batch_per_worker=1, precision="bf16", optimizer="adam")
    names = ("ddp", "zero2", "zero3", "1f1b", "tp", "3d")
    big = gpt(GPT_SHAPES["gpt-13b"], "gpt-13b", cluster.device_flops or 1.0)
    rec = recommend(sweep(big, cluster, wl, names, (64,)), 64)
    assert rec.strategy == "3d", rec.text()
    assert "tp 8 inside a node × dp 8 across nodes" in rec.lines[0]
    small = gpt(GPT_SHAPES["gpt-1.3b"], "gpt-1.3b", cluster.device_flops or 1.0)
    wl4 = Workload(batch_per_worker=4, precision="bf16", optimizer="adam")
    assert recommend(sweep(small, cluster, wl4, names, (512,)), 512).strategy != "3d"


def test_cli_simulates_the_tensor_parallel_strategies(capsys):
    assert main(["simulate", "--model", "gpt-13b", "--cluster", "cluster-400g",
                 "--batch-per-worker", "1", "--precision", "bf16", "--optimizer", "adam",
                 "-n", "64", "--strategies", "zero2,tp,tp-sp,3d"]) == 0
    out = capsys.readouterr().out
    assert "64 workers: 3d" in out and "cannot run: n_heads=40 does not divide by tp 64" in out
