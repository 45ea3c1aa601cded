"""Hybrid sharding in the shared loop (``--dp-shard 2`` on 4 ranks: ZeRO inside pairs,
the pairs replicas of each other) trains the TransformerLM to the single process's
parameters, loss and accuracy (fp32, Adam, within 1e-5 relative) under stages 1-3; with the
ring algorithm every rank's bytes per step equal the two communicators' formula."""

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
