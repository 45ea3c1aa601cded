"""Context parallelism in the shared loop (preset ``cp``, ``--cp`` on ``3d``) trains the
TransformerLM to the single process's parameters, loss and accuracy (fp32, Adam, within
1e-5 relative): cp 2 and 3 alone (the ring), cp 2 × dp 2 (DDP and ZeRO-1), cp 2 × tp 2 with the ring
and with Ulysses (and sequence parallelism); with the ring algorithm every rank's bytes per
step equal the formula exactly. A checkpoint written under cp resumes exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.data import DataOptions
from tests.test_tensor_parallel_strategies import CONFIG, check, rank_train

RING = {"algorithm": "ring"}


def single(config: TrainConfig) -> tuple[dict[str, torch.Tensor], object]:
    torch.set_num_threads(1)
    result = train(config)
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}, result


@pytest.fixture(scope="module")
def reference():
    return single(CONFIG)


@pytest.mark.parametrize(("strategy", "world", "options"), [
    ("cp", 2, RING),
    ("cp", 4, {"cp_size": 2, **RING}),
    ("3d", 4, {"dp_size": 2, "cp_size": 2, "zero": 1, **RING}),
    ("3d", 4, {"cp_size": 2, "tp_size": 2, **RING}),
    ("3d", 4, {"cp_size": 2, "tp_size": 2, "cp_variant": "ulysses", "sequence_parallel": True,
               **RING}),
], ids=["cp2", "dp2-cp2", "dp2-cp2-zero1", "cp2-tp2", "cp2-tp2-sp-ulysses"])
def test_context_parallel_equals_single_process(pools, reference, strategy, world, options):
    config = dataclasses.replace(CONFIG, strategy=strategy, parallel=ParallelOptions(**options))
    check(pools(world).run(rank_train, config), reference)


def test_context_parallel_over_three_ranks(pools):
    """cp = 3: sequences of 12 tokens in six chunks (the zig-zag split); the ring (the
    model's 4 heads do not split over 3 ranks for Ulysses: tests/test_context_parallel_dist
    runs Ulysses at cp = 3 on a model of 6 heads)."""
    config = dataclasses.replace(CONFIG, data=DataOptions(num_samples=80, seq_len=12,
                                                          vocab_size=48))
    run = dataclasses.replace(config, strategy="cp", parallel=ParallelOptions(**RING))
    check(pools(3).run(rank_train, run), single(config))


def test_a_context_parallel_checkpoint_resumes_exactly(pools, tmp_path):
    """Two steps, a checkpoint (written once: cp ranks hold the same model), two more steps
    after a resume: the same parameters as four steps in one go."""
    base = dataclasses.replace(CONFIG, strategy="cp", steps=4, parallel=ParallelOptions(**RING))
    straight = pools(2).run(rank_train, base)
    first = dataclasses.replace(base, steps=2, checkpoint_dir=str(tmp_path))
    pools(2).run(rank_train, first)
    resumed = pools(2).run(rank_train, dataclasses.replace(first, steps=4, resume=True))
    for (want, _), (got, result) in zip(straight, resumed):
        assert result.start_step == 2
        assert all(torch.equal(want[k], got[k]) for k in want)
