"""The simulator's cp and ep rows: context parallelism runs where a batch has fewer
sequences than ranks (data parallelism cannot) and keeps 1/cp of the activations; expert
parallelism holds 1/ep of the experts, needs a model with experts that divide over ep."""

from __future__ import annotations

import math

import pytest

from disttrain.simulate.analytic import ANALYTIC
from disttrain.simulate.base import Case, explain_efficiency
from disttrain.simulate.cluster import get_cluster
from disttrain.simulate.strategies import STRATEGIES
from disttrain.simulate.workload import Workload

CLUSTER = get_cluster("cluster-400g")


def row(strategy: str, model: str, workers: int, global_batch: int):
    profile = ANALYTIC[model](CLUSTER.device_flops)
    return STRATEGIES[strategy](Case(profile, CLUSTER, Workload(global_batch=global_batch,
                                                                 precision="bf16"), workers))


def test_context_parallelism_runs_where_the_batch_has_fewer_sequences_than_ranks():
    ddp, cp = row("ddp", "gpt-1.3b-32k", 16, 4), row("cp", "gpt-1.3b-32k", 16, 4)
    assert ddp.error is not None and "without a sample" in ddp.error
    assert cp.error is None and math.isfinite(cp.step_s) and cp.bytes_sent > 0
    # at a sequence per rank (16 over 16), cp's ranks hold as many tokens as ddp's: the
    # same activations; at 4 sequences over 16 ranks, a quarter of them
    assert row("cp", "gpt-1.3b-32k", 16, 16).memory_bytes > cp.memory_bytes


def test_context_parallelism_refuses_a_sequence_that_does_not_split():
    bad = row("cp", "gpt-1.3b-32k", 3, 3)  # 32768 tokens do not cut into 6 chunks
    assert bad.error is not None and "zig-zag" in bad.error


def test_expert_parallelism_holds_a_share_of_the_experts():
    ddp, ep = row("ddp", "gpt-1.3b-moe8", 8, 64), row("ep", "gpt-1.3b-moe8", 8, 64)
    assert ep.error is None and ep.memory_bytes < ddp.memory_bytes
    # above 100 % only by the optimizer steps it saves (1/ep of the experts' state)
    profile = ANALYTIC["gpt-1.3b-moe8"](CLUSTER.device_flops)
    case = Case(profile, CLUSTER, Workload(global_batch=64, precision="bf16"), 8)
    assert "a simulator error" not in " ".join(explain_efficiency(case, ep).notes)
    assert "do not divide" in (row("ep", "gpt-1.3b-moe8", 16, 64).error or "")
    assert "none" in (row("ep", "gpt-1.3b", 8, 64).error or "")


def test_hybrid_sharding_keeps_zero3s_gathers_inside_a_node():
    """zero3 on 64 GPUs of cluster-400g with --dp-shard 8: each node's GPUs shard the model
    and the nodes replicate it; the step is shorter (the gathers stay on NVLink), each
    device holds 1/8 of the states instead of 1/64, and the row says how it is split."""
    from disttrain.simulate import memory

    profile = ANALYTIC["gpt-1.3b"](CLUSTER.device_flops)

    def zero3(shard: int | None):
        workload = Workload(batch_per_worker=2, precision="bf16", dp_shard=shard)
        return STRATEGIES["zero3"](Case(profile, CLUSTER, workload, 64))

    plain, hybrid = zero3(None), zero3(8)
    assert hybrid.step_s < plain.step_s and hybrid.memory_bytes > plain.memory_bytes
    k = Workload(precision="bf16").k_bytes  # the optimizer's state bytes per parameter
    states = [memory.model_states(3, profile.params, n, 2, k).total for n in (64, 8)]
    assert hybrid.memory_bytes - plain.memory_bytes == pytest.approx(states[1] - states[0])
    assert hybrid.notes[0] == "hybrid: shard 8 × replicate 8"
    assert "does not divide" in (zero3(7).error or "")
