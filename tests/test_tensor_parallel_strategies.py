"""The mesh strategies in the shared loop train the TransformerLM to the single process's
parameters (fp32, Adam, within 1e-5 relative): tp and tp-sp on 2 and 4 ranks, dp × tp × pp
= 2 × 2 × 1 (plain, ZeRO-1 with SP, ZeRO-2) and 1 × 2 × 2 (with and without SP), and
torch's own tensor parallelism on 2; with the ring algorithm, every rank's bytes per step
equal the formula exactly."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.data import DataOptions
from tests.tensor_parallel_cases import worst_relative_error

CONFIG = TrainConfig(model="transformer", dataset="synthetic-lm",
                     data=DataOptions(num_samples=80, seq_len=8, vocab_size=48), steps=3,
                     global_batch=8, optimizer="adam", lr=1e-3, eval_every=0, log_every=0,
                     progress=False)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    result = train(CONFIG)
    return {k: v.detach().clone() for k, v in result.model.state_dict().items()}, result


def rank_train(comm, config: TrainConfig):
    result = train(config, comm)
    state = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    return state, result.without_model()


def check(per_rank, reference, *, split: bool = False, exact_bytes: bool = True) -> None:
    want, ref = reference
    seen: set[str] = set()
    for rank, (got, result) in enumerate(per_rank):
        expected = want if not split else {k: v for k, v in want.items() if k in got}
        err, name = worst_relative_error(got, expected)
        assert err < 1e-5, (rank, name, err)
        seen |= set(got)
        assert result.final_loss == pytest.approx(ref.final_loss, rel=1e-5)
        assert result.accuracy == ref.accuracy
        if exact_bytes:
            assert result.bytes_sent_per_step == [result.theory_bytes_per_step] * 3, rank
    assert seen == set(want)


RING = {"algorithm": "ring"}


@pytest.mark.parametrize(("strategy", "world", "options", "split"), [
    ("tp", 2, RING, False),
    ("tp-sp", 4, RING, False),
    ("3d", 4, {"dp_size": 2, "tp_size": 2, **RING}, False),
    ("3d", 4, {"dp_size": 2, "tp_size": 2, "zero": 1, "sequence_parallel": True, **RING},
     False),
    ("3d", 4, {"dp_size": 2, "tp_size": 2, "zero": 2, **RING}, False),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 2, **RING}, True),
    ("3d", 4, {"tp_size": 2, "pp_size": 2, "microbatches": 4, "sequence_parallel": True,
               "schedule": "gpipe", **RING}, True),
], ids=["tp-2", "tp-sp-4", "dp2-tp2", "dp2-tp2-zero1-sp", "dp2-tp2-zero2", "tp2-pp2",
        "tp2-pp2-sp-gpipe"])
def test_mesh_strategies_equal_single_process(pools, reference, strategy, world, options,
                                              split):
    config = dataclasses.replace(CONFIG, strategy=strategy, parallel=ParallelOptions(**options))
    check(pools(world).run(rank_train, config), reference, split=split)


@pytest.mark.parametrize("zero", [None, 2])
def test_gradient_accumulation_inside_the_mesh(pools, reference, zero):
    """Two micro-batches per step: DataParallel's no_sync (or ZeRO-2's) and the TP
    collectives of both micro-batches, the same update as one process."""
    config = dataclasses.replace(CONFIG, strategy="3d", accumulate=2, parallel=ParallelOptions(
        dp_size=2, tp_size=2, zero=zero, **RING))
    check(pools(4).run(rank_train, config), reference)


@pytest.mark.parametrize("strategy", ["torch-tp", "torch-tp-sp"])
def test_torch_tensor_parallel_baseline_equals_single_process(pools, reference, strategy):
    config = dataclasses.replace(CONFIG, strategy=strategy)
    check(pools(2).run(rank_train, config), reference, exact_bytes=False)


@pytest.mark.parametrize(("strategy", "options"), [
    ("tp", {}), ("3d", {"tp_size": 2, "pp_size": 2, "microbatches": 2})])
def test_checkpoints_resume_exactly(pools, tmp_path, strategy, options):
    """Two steps, a checkpoint (one file per tp rank and stage), two more steps after a
    resume: the same parameters as four steps in one go."""
    world = 2 if strategy == "tp" else 4
    base = dataclasses.replace(CONFIG, strategy=strategy, steps=4,
                               parallel=ParallelOptions(**options))
    straight = pools(world).run(rank_train, base)
    first = dataclasses.replace(base, steps=2, checkpoint_dir=str(tmp_path))
    pools(world).run(rank_train, first)
    resumed = pools(world).run(rank_train, dataclasses.replace(first, steps=4, resume=True))
    for (want, _), (got, result) in zip(straight, resumed):
        assert result.start_step == 2
        assert want.keys() == got.keys()
        assert all(torch.equal(want[k], got[k]) for k in want)
