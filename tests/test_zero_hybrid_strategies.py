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
