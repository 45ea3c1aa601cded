"""Hybrid sharding and meta-device initialisation in the shared loop. ``--dp-shard 2`` on 4
ranks (ZeRO inside pairs, the pairs replicas of each other) and ``--meta-init`` (the model
built on the meta device) train the TransformerLM to the single process's parameters, loss
and accuracy (fp32, Adam, within 1e-5 relative); with the ring algorithm every rank's bytes
per step equal the formula (both communicators' under hybrid sharding)."""

from __future__ import annotations

import dataclasses

import pytest

from disttrain.train import ParallelOptions
from tests.test_tensor_parallel_strategies import CONFIG, check, rank_train, reference

__all__ = ["reference"]  # the module-scoped fixture, shared


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_hybrid_sharding_equals_single_process(pools, reference, strategy):
    config = dataclasses.replace(CONFIG, strategy=strategy, parallel=ParallelOptions(
        dp_shard=2, algorithm="ring"))
    per_rank = pools(4).run(rank_train, config)
    check(per_rank, reference)
    assert all(result.dp_size == 4 for _, result in per_rank)


@pytest.mark.parametrize(("strategy", "world", "options"), [
    ("zero3", 2, {}), ("zero2", 2, {}), ("zero3", 4, {"dp_shard": 2})],
    ids=["zero3", "zero2", "zero3-hybrid"])
def test_meta_init_in_the_loop_trains_as_eager_init(pools, reference, strategy, world,
                                                    options):
    """--meta-init: the model built on the meta device, each rank materialising its shards
    from the shared seed, then trained: the single process's parameters, loss and bytes."""
    config = dataclasses.replace(CONFIG, strategy=strategy, parallel=ParallelOptions(
        meta_init=True, algorithm="ring", **options))
    per_rank = pools(world).run(rank_train, config)
    check(per_rank, reference)
    assert all(result.extras["meta_init"] for _, result in per_rank)


def test_the_benchmark_plans_a_meta_row_beside_each_eager_zero_row():
    """``disttrain bench --meta-init --dp-shard 2``: every ZeRO row twice, the second built on
    the meta device (named +meta), both hybrid; the rows pass the checks made before any
    rank starts; the note names what wrapping held and how the model was initialised."""
    from disttrain.bench.experiments import BenchConfig, plan
    from disttrain.bench.report import zero_notes
    from disttrain.bench.strategy_bench import train_config
    from disttrain.train.loop import checked_setup

    config = BenchConfig.from_preset("transformer", strategies=("ddp", "zero3"),
                                     world_sizes=(4,), meta_init=True, dp_shard=2)
    runs = [r for r in plan(config) if r.world_size == 4]
    assert [r.name for r in runs] == ["ddp", "zero3", "zero3+meta"]
    for run in runs:
        checked_setup(train_config(config, run), run.ranks)
    meta = train_config(config, runs[2]).parallel
    assert meta.meta_init and meta.dp_shard == 2 and not train_config(
        config, runs[1]).parallel.meta_init
    row = {"strategy": "zero3+meta", "world_size": 4, "error": None, "extras": {
        "wrap_peak_bytes": 2048, "meta_init": True, "dp_shard": 2, "dp_replicate": 2}}
    assert zero_notes([row]) == ["zero3+meta n=4: hybrid: shard 2 × replicate 2; wrapping "
                                 "held 2 KiB at its peak (meta-device init)"]
