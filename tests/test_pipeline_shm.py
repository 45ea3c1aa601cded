"""The pipeline over the shared-memory transport: the same equivalence with single-process
training as over Gloo (GPipe and 1F1B, uneven micro-batches, evaluation), and a changing
batch size (RESHAPE headers, each payload right behind its header) with evaluations in
between."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports import make_transport
from disttrain.parallel.pipeline import build_pipeline
from tests.test_pipeline_runtime import batches, check_equivalence, make_model, reference


def equivalence_on_shm(_comm: Communicator, cases: list[tuple]) -> list[tuple]:
    comm = Communicator(make_transport("shm"), CommConfig(timeout_s=20))
    try:
        return check_equivalence(comm, cases)
    finally:
        comm.close()


@pytest.mark.parametrize("p,cases", [
    (2, [("gpipe", 4, "params"), ("1f1b", 5, [3, 4])]),
    (3, [("1f1b", 6, [2, 2, 3]), ("gpipe", 2, "params")]),
])
def test_pipeline_on_shared_memory_equals_single_process(pools, p, cases):
    per_rank = pools(p).run(equivalence_on_shm, cases)
    assert all(seen == per_rank[0] for seen in per_rank)


def batch_sizes_on_shm(_comm: Communicator) -> list[float]:
    """Train with batch sizes 12, 9, 12 (new sizes: RESHAPE headers, each payload right
    behind its header) and compare each step's loss with single-process training on that batch."""
    comm = Communicator(make_transport("shm"), CommConfig(timeout_s=20))
    try:
        pipe = build_pipeline(make_model(), comm, schedule="1f1b", microbatches=4,
                              partition="params")
        losses = []
        for rows in (12, 9, 12):
            x, y = batches(rows, 1)[0]
            expected = reference([(x, y)])[0][0]
            for q in pipe.parameters():
                q.grad = None
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                   F.cross_entropy)
            assert loss == pytest.approx(expected, rel=1e-12)
            losses.append(loss)
            pipe.eval_forward(x[:5] if pipe.is_first else None)
        return losses
    finally:
        comm.close()


def test_changing_batch_sizes_on_shared_memory(pools):
    first, last = pools(2).run(batch_sizes_on_shm)
    assert first == last and len(first) == 3  # the loss reaches every stage
