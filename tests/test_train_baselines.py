"""The FSDP and DeepSpeed baseline rows train the single process's model: torch's FSDP2
(``torch-fsdp``), DeepSpeed's engine at ZeRO stages 0-3 and its pipeline engine end with the
reference's parameters after 4 Adam steps on 2 ranks, and hold the model-state bytes their
design says.
The DeepSpeed tests are skipped when DeepSpeed is not installed (``pip install
'disttrain[baselines]'``); they run in fresh processes because DeepSpeed keeps process-wide
state (its communication backend, the launcher's variables it needs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.strategies import STRATEGIES, BuildContext
from tests.dist import init_gloo, run_fresh
from tests.test_train_strategies import assert_matches, params, rank_train

CONFIG = TrainConfig(model="mlp", optimizer="adam", lr=2e-3, steps=4, global_batch=48,
                     log_every=0, progress=False)


@pytest.fixture(scope="module")
def reference():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(CONFIG)
    finally:
        torch.set_num_threads(before)


def test_torch_fsdp_matches_single_and_shards_like_zero3(pools, reference):
    per_rank = pools(2).run(rank_train, dataclasses.replace(CONFIG, strategy="torch-fsdp"))
    assert_matches(per_rank, reference)
    psi = sum(t.numel() for t in params(reference).values())
    for _, result in per_rank:
        assert result.bytes_sent_per_step is None  # torch's traffic: not counted
        assert result.theory_bytes_per_step == 3 * 0.5 * 4 * psi
        # 16Ψ/N, plus Adam's step counters
        assert result.model_state_bytes["total"] == pytest.approx(16 * psi / 2, rel=0.01)


def fresh_train(rank: int, world_size: int, store: str, config: TrainConfig):
    """A fresh rank's parameters (as numpy: a tensor would travel as a handle to memory
    of a process about to exit) and result."""
    comm = init_gloo(rank, world_size, store)
    try:
        got, result = rank_train(comm, config)
        return {k: v.numpy() for k, v in got.items()}, result
    finally:
        comm.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_matches_single(reference, stage):
    pytest.importorskip("deepspeed")
    name = "deepspeed-ddp" if stage == 0 else f"deepspeed-zero{stage}"
    per_rank = [({k: torch.from_numpy(v) for k, v in got.items()}, result) for got, result
                in run_fresh(fresh_train, 2, dataclasses.replace(CONFIG, strategy=name),
                             timeout_s=240)]
    assert_matches(per_rank, reference)
    psi = sum(t.numel() for t in params(reference).values())
    for _, result in per_rank:
        state = result.model_state_bytes["total"]
        assert result.model_state_formula_bytes["total"] > 0
        if stage == 0:  # a replica: 4Ψ of parameters and 8Ψ of Adam state at least
            assert state >= 12 * psi
        else:  # sharded state: below a replica's 16Ψ (DeepSpeed keeps fp32 master
            assert state < 16 * psi  # partitions and flat copies beyond the formula)


@pytest.mark.timeout(300)
def test_deepspeed_pipeline_engine_matches_single(reference):
    """DeepSpeed's pipeline engine, one stage per rank, 4 micro-batches: each rank ends with
    its stage's layers as the single process has them, and the same losses."""
    pytest.importorskip("deepspeed")
    config = dataclasses.replace(CONFIG, strategy="deepspeed-pipe",
                                 parallel=ParallelOptions(microbatches=4))
    per_rank = [({k: torch.from_numpy(v) for k, v in got.items()}, result) for got, result
                in run_fresh(fresh_train, 2, config, timeout_s=240)]
    assert_matches(per_rank, reference, split=True)
    for _, result in per_rank:
        assert result.losses == pytest.approx(reference.losses, rel=1e-5)


def test_deepspeed_rows_are_refused_with_the_install_command_when_missing(monkeypatch):
    from disttrain.baselines import deepspeed_rows as deepspeed_baseline
    from disttrain.train.loop import checked_setup

    monkeypatch.setattr(deepspeed_baseline, "available", lambda: False)
    with pytest.raises(ValueError, match=r"needs DeepSpeed.*pip install 'disttrain\[baselines\]'"):
        checked_setup(dataclasses.replace(CONFIG, strategy="deepspeed-zero2"), 2)


# What each strategy's communicator is told before the strategy is built (the Gloo I/O-thread
# policy): collectives for data parallelism, ZeRO, tensor, context and expert parallelism
# (cp's ring also sends point-to-point, which turns the policy to normal for good), p2p for
# DeepSpeed's pipeline engine, nothing (learned from the first isend) for pipelines and
# parameter servers.
COLLECTIVES = ("ddp", "zero1", "zero2", "zero3", "torch-ddp", "torch-zero1", "torch-fsdp",
               "deepspeed-ddp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3",
               "tp", "tp-sp", "torch-tp", "torch-tp-sp", "cp", "ep")
WORKLOADS = {**dict.fromkeys(COLLECTIVES, "collectives"), "deepspeed-pipe": "p2p"}


class _Told:
    world_size = 4

    def __init__(self) -> None:
        self.told: list[str] = []

    def expect_workload(self, workload: str) -> None:
        self.told.append(workload)


@pytest.mark.parametrize(("name", "parallel"), [
    *[(name, ParallelOptions()) for name in STRATEGIES],
    ("3d", ParallelOptions(dp_size=1, pp_size=1, tp_size=4)),  # tensor parallel only
    ("3d", ParallelOptions(dp_size=1, pp_size=2, tp_size=2)),  # a pipeline: learned from use
])
def test_each_strategy_tells_its_communicator_its_workload_before_it_is_built(name, parallel):
    comm, built = _Told(), []
    spec = dataclasses.replace(STRATEGIES[name], build=lambda ctx: built.append(list(comm.told)))
    config = dataclasses.replace(CONFIG, strategy=name, parallel=parallel)
    spec.make(BuildContext(torch.nn.Linear(1, 1), comm, None, config, (None, None)))
    expected = WORKLOADS.get(name) or ("collectives" if name == "3d" and parallel.pp_size in
                                                         (None, 1) else None)
    assert built == [[] if expected is None else [expected]], name
