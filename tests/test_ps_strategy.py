"""The parameter-server strategies in the shared training loop: ``ps-sync`` trains exactly the
single process's model on the global batch (workers and servers all end with it), with
gradient accumulation and an evaluation in the middle of training; a server's rank runs no
loop and builds no strategy (disttrain.train.ps_server); ``ps-ssp`` with a straggler keeps
its staleness bound; the loop's results and extras add up over workers and servers; a run's
end checkpoint resumes ``ps-sync`` exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from disttrain.parallel.parameter_server import assign_roles
from disttrain.parallel.parameter_server.channel import TRAILER_BYTES
from disttrain.train import ParallelOptions, TrainConfig, train
from disttrain.train.loop import _Run
from disttrain.train.strategies import Strategy
from disttrain.train.strategies.parameter_server import (
    HEADER_BYTES,
    resume_from,
    server_optimizer,
)

ONE_SAMPLE = 1.01 / 359  # one held-out digit
# float32; only the order of the gradient sums differs
TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def quiet(**kwargs: Any) -> TrainConfig:
    return TrainConfig(model="mlp", log_every=0, progress=False, **kwargs)


def rank_train(comm: Any, config: TrainConfig) -> tuple[dict[str, torch.Tensor], Any]:
    result = train(config, comm)
    assert result.model is not None
    state = {k: v.detach().clone() for k, v in result.model.state_dict().items()}
    return state, result.without_model()


@pytest.mark.nccl_rules
def test_ps_sync_strategy_equals_single_on_the_global_batch(pools: Any) -> None:
    # one evaluation mid-training; two micro-batches per worker and step, pushed once
    config = quiet(steps=6, global_batch=32, accumulate=2, eval_every=3)
    reference = train(config)
    assert reference.model is not None
    want = {k: v.detach() for k, v in reference.model.state_dict().items()}
    ps = dataclasses.replace(config, strategy="ps-sync")
    per_rank = pools(3).run(rank_train, ps)  # workers: ranks 0, 1; server: rank 2
    for rank, (got, result) in enumerate(per_rank):
        for name, tensor in got.items():  # the servers end with the final model too
            torch.testing.assert_close(tensor, want[name], **TOL, msg=f"rank {rank} {name}")
        assert result.steps == 6 and result.dp_size == 2
        assert result.final_loss == pytest.approx(reference.final_loss, rel=1e-5)
    worker = per_rank[0][1]
    for mine, theirs in zip(worker.evaluations, reference.evaluations, strict=True):
        assert mine.step == theirs.step
        assert mine.accuracy == pytest.approx(theirs.accuracy, abs=ONE_SAMPLE)
    params = sum(t.numel() * 4 for t in want.values())
    assert worker.bytes_sent_per_step_max == worker.theory_bytes_per_step_max == (
        params + 2 * HEADER_BYTES + TRAILER_BYTES)
    extras = worker.extras
    assert extras["staleness"] == {"0": 2 * 6} and extras["staleness_max"] == 0
    assert extras["samples_per_s"] > 0 and extras["workers"] == 2
    assert extras["dense_bytes_per_step"] == 2 * params  # push and pull of every value


def spied_rank_train(comm: Any, config: TrainConfig) -> tuple[list[str], Any, Any, str]:
    """``rank_train`` recording every Strategy this rank builds; on a server's rank, then
    what the loop says when asked to run there."""
    built: list[str] = []
    real = Strategy.__init__

    def spy(self: Strategy, *args: Any, **kwargs: Any) -> None:
        built.append(type(self).__name__)
        real(self, *args, **kwargs)

    Strategy.__init__ = spy  # type: ignore[method-assign]
    try:
        state, result = rank_train(comm, config)
    finally:
        Strategy.__init__ = real  # type: ignore[method-assign]
    refusal = ""
    if comm.rank == 2:  # the server: the loop's strategy refuses before any message
        with pytest.raises(ValueError) as refused:
            _Run(config, comm)
        refusal = str(refused.value)
    return built, state, result, refusal


def test_a_server_rank_runs_no_loop_and_builds_no_strategy(pools: Any) -> None:
    # 2 workers + 1 server: the workers build their strategy and step through the loop;
    # the server serves, then meets their ending, and reports what was gathered
    config = quiet(strategy="ps-sync", steps=4, global_batch=32, eval_every=2)
    per_rank = pools(3).run(spied_rank_train, config)
    (_, want, worker, _), (_, _, other, _) = per_rank[:2]
    built, got, server, refusal = per_rank[2]
    assert built == [] and [r[0] for r in per_rank[:2]] == [["WorkerRankStrategy"]] * 2
    assert len(worker.step_times) == len(worker.losses) == 4
    assert server.step_times == server.losses == server.learning_rates == []
    assert server.steps == 4 and server.dp_size == 2 and server.rank == 2
    assert [e.step for e in worker.evaluations] == [2, 4]  # the server scores the last only
    assert server.evaluations == [worker.evaluations[-1]] == [other.evaluations[-1]]
    assert (server.accuracy, server.eval_loss, server.final_loss) == (
        worker.accuracy, worker.eval_loss, worker.final_loss)
    assert server.bytes_sent_per_step_max == worker.bytes_sent_per_step_max > 0
    assert server.extras == worker.extras  # sums over every survivor
    for name, tensor in got.items():  # the final model, as the workers hold it
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    assert refusal.startswith("server 0 (rank 2) serves parameters") and "\n" not in refusal


@pytest.mark.nccl_rules
def test_ps_ssp_strategy_keeps_its_bound_with_a_straggler(pools: Any) -> None:
    options = ParallelOptions(servers=2, staleness=1, straggler=((1, 3.0),))
    config = quiet(strategy="ps-ssp", steps=8, global_batch=32, eval_every=0,
                   parallel=options)
    per_rank = pools(4).run(rank_train, config)  # workers 0, 1; servers 2, 3
    results = [r for _, r in per_rank]
    extras = results[0].extras
    assert sum(extras["staleness"].values()) == 2 * 2 * 8  # servers × workers × steps
    assert 0 < extras["staleness_max"] <= (2 - 1) * (2 * 1 + 1), extras["staleness"]
    assert extras["straggler_sleep_s"] > 0 and extras["servers"] == 2
    first = per_rank[0][0]
    for state, _ in per_rank[1:]:  # the final broadcast: every rank holds the same model
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, first[name], rtol=0, atol=0)
    assert all(r.final_loss == pytest.approx(results[0].final_loss) for r in results)


@pytest.mark.parametrize(("strategy", "staleness", "lr"),
                         [("ps-sync", None, 0.1), ("ps-ssp", 0, 0.1), ("ps-ssp", 2, 0.025),
                          ("ps-async", None, 0.025)])
def test_servers_divide_the_lr_by_w_where_pushes_apply_on_arrival(
        strategy: str, staleness: int | None, lr: float) -> None:
    config = quiet(strategy=strategy, lr=0.1, parallel=ParallelOptions(staleness=staleness))
    optimizer = server_optimizer(config, 4)([torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(lr)


def test_ps_sync_stops_and_resumes_to_the_uninterrupted_parameters(pools: Any,
                                                                   tmp_path: Any) -> None:
    # servers write their shards (values, momentum, version, clock) at the end of a run; a
    # run with resume restores them before serving and the workers continue the data order
    config = quiet(strategy="ps-sync", steps=6, global_batch=32, eval_every=0, momentum=0.9,
                   parallel=ParallelOptions(servers=2))
    pool = pools(4)  # workers 0, 1; servers 2, 3
    whole = pool.run(rank_train, config)
    stop = dataclasses.replace(config, steps=4, checkpoint_dir=str(tmp_path))
    pool.run(rank_train, stop)
    assert sorted(p.name for p in (tmp_path / "step-00000004").glob("ps-*")) == [
        "ps-run.pt", "ps-server-000", "ps-server-001"]
    other = dataclasses.replace(stop, strategy="ps-async", resume=True)  # lr ÷ W, not lr
    with pytest.raises(ValueError, match="written by ps-sync with 2 workers; resume it with"):
        resume_from(other, assign_roles(4, 2))
    resumed = pool.run(rank_train, dataclasses.replace(config, checkpoint_dir=str(tmp_path),
                                                       resume=True))
    for rank, ((got, result), (want, full)) in enumerate(zip(resumed, whole, strict=True)):
        assert result.start_step == 4 and result.steps == 6
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, want[name], rtol=0, atol=0,
                                       msg=f"rank {rank} {name}")
        assert result.final_loss == full.final_loss
    assert resumed[0][1].extras["staleness"] == {"0": 2 * 2 * 2}  # 2 steps × 2 servers × W
    again = pool.run(rank_train, dataclasses.replace(config, checkpoint_dir=str(tmp_path),
                                                     resume=True))  # nothing left to train
    assert all(r.start_step == 6 and r.steps == 6 for _, r in again)


def test_ps_refuses_mid_run_checkpoints() -> None:
    from disttrain.train.loop import checked_setup

    config = quiet(strategy="ps-async", steps=4, checkpoint_dir="unused", checkpoint_every=2)
    with pytest.raises(ValueError, match="at the end of a run only"):
        checked_setup(config, 3)  # 2 workers + 1 server; refused before any rank starts
    checked_setup(dataclasses.replace(config, checkpoint_every=0), 3)


@pytest.mark.nccl_rules
def test_every_rank_reports_the_final_evaluation_of_the_final_parameters(pools: Any) -> None:
    # 3 workers + 2 servers: the servers once scored only worker 0's shard of the held-out
    # split (0.611 against the workers' 0.657); the final evaluation is one over all ranks
    config = quiet(strategy="ps-sync", steps=12, global_batch=30, eval_every=0,
                   parallel=ParallelOptions(servers=2))
    per_rank = pools(5).run(rank_train, config)
    results = [r for _, r in per_rank]
    reference = train(dataclasses.replace(config, strategy="single", parallel=ParallelOptions(),
                                          steps=12))
    for rank, result in enumerate(results):
        assert (result.accuracy, result.eval_loss) == (results[0].accuracy,
                                                       results[0].eval_loss), rank
        assert result.evaluations[-1].step == 12
    assert results[0].accuracy == pytest.approx(reference.accuracy, abs=ONE_SAMPLE)
    assert results[0].eval_loss == pytest.approx(reference.eval_loss, rel=1e-4)
