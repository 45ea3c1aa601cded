"""Expert parallelism in the shared loop (preset ``ep``) trains ``transformer-moe`` to the
single process's parameters, loss and accuracy (fp32, Adam, within 1e-5 relative), the same
tokens dropped: ep 2, and dp 2 × ep 2; with the ring algorithm (pairwise all-to-alls) every
rank's bytes equal the formula for the rows its steps routed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions, train
from tests.test_tensor_parallel_strategies import CONFIG, check, rank_train

MOE = dataclasses.replace(CONFIG, model="transformer-moe")


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    result = train(MOE)
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}, result


@pytest.mark.parametrize(("world", "options"), [(2, {}), (4, {"ep_size": 2})],
                         ids=["ep2", "dp2-ep2"])
def test_expert_parallel_equals_single_process(pools, reference, world, options):
    config = dataclasses.replace(MOE, strategy="ep", parallel=ParallelOptions(
        algorithm="ring", **options))
    per_rank = pools(world).run(rank_train, config)
    check(per_rank, reference, exact_bytes=False)
    for _, result in per_rank:  # routing decides each step's rows: the theory is their mean
        sent = result.bytes_sent_per_step
        assert sum(sent) / len(sent) == pytest.approx(result.theory_bytes_per_step, rel=1e-12)
        assert len(set(sent)) > 1  # the steps moved different rows: a per-step figure
