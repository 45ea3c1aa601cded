"""Parameter server on real ranks: sync equals one process (and DataParallel), SSP(0) equals
sync, SSP reads hold what Ho et al.'s bound promises and staleness stays within its bound,
async converges and records staleness, sparse embeddings train exactly and send a tenth of
the bytes, and checkpoints resume exactly.

Worker w trains on rows [w·b, (w+1)·b) of global batch ``clock``; the single-process
references train on the whole global batch of W·b rows (tests/ps_cases.py).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from disttrain.comm import Communicator
from disttrain.parallel import DataParallel
from disttrain.parallel.checkpoint_files import verify
from disttrain.parallel.parameter_server import StalenessHistogram, load_checkpoint, partition
from disttrain.parallel.parameter_server.partition import gather_flat, specs_of
from tests.ps_cases import (
    OPTIMIZERS,
    linreg_batch,
    loss_of,
    make_linreg,
    make_mlp,
    mlp_batch,
    ps_train,
    reference,
)

STEPS, B = 4, 5


def _workers(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r["role"] == "worker"]


def _servers(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in results if r["role"] == "server"]


def _assert_params(results: list[dict[str, Any]], expected: list[torch.Tensor], **tol: Any) -> None:
    for worker in _workers(results):
        for got, want in zip(worker["params"], expected, strict=True):
            torch.testing.assert_close(got, want, **tol)


def _staleness(results: list[dict[str, Any]]) -> StalenessHistogram:
    hists = [s["report"].histogram for s in _servers(results)]
    return hists[0].merge(hists[1:])


@functools.cache
def _sync_run(pools: Any) -> list[dict[str, Any]]:
    return pools(3).run(ps_train, 1, STEPS, B, mode="sync")  # type: ignore[no-any-return]


@pytest.mark.nccl_rules
@pytest.mark.parametrize(("servers", "world", "opt"), [(1, 3, "sgd"), (2, 4, "adam")])
def test_sync_equals_one_process_on_the_global_batch(pools: Any, servers: int, world: int,
                                                     opt: str) -> None:
    results = (_sync_run(pools) if (servers, opt) == (1, "sgd") else
               pools(world).run(ps_train, servers, STEPS, B, opt=opt, mode="sync"))
    workers = world - servers
    _assert_params(results, reference("mlp", opt, STEPS, workers * B))
    assert _staleness(results).as_dict() == {0: servers * workers * STEPS}
    for server in _servers(results):
        assert server["report"].version == STEPS and server["report"].rejected == {}


def ddp_train(comm: Communicator) -> list[torch.Tensor]:
    model = make_mlp(seed=0)
    ddp = DataParallel(model, comm)
    opt = OPTIMIZERS["sgd"](ddp.parameters())
    p, r = comm.world_size, comm.rank
    for step in range(STEPS):
        x, y = mlp_batch(step, p * B)
        opt.zero_grad()
        F.cross_entropy(ddp(x[r * B:(r + 1) * B]), y[r * B:(r + 1) * B]).backward()
        opt.step()
    return [q.detach().clone() for q in model.parameters()]


def test_sync_equals_data_parallel(pools: Any) -> None:
    ddp = pools(2).run(ddp_train)[0]
    _assert_params(_sync_run(pools), ddp)


@pytest.mark.nccl_rules
def test_ssp_with_bound_zero_is_sync(pools: Any) -> None:
    ssp = pools(3).run(ps_train, 1, STEPS, B, mode="ssp", staleness=0)
    sync_params = _workers(_sync_run(pools))[0]["params"]
    _assert_params(ssp, sync_params, rtol=0, atol=0)  # the same sums in the same order
    assert _staleness(ssp).max == 0


def _present(read: torch.Tensor, workers: int) -> set[tuple[int, int]]:
    """The (clock, worker) updates a read of the Slots model contains."""
    lr = 0.05  # plain-sgd: an applied update raises its slot from 0 to lr
    return {(int(i) // workers, int(i) % workers) for i in (read > lr / 2).nonzero()}


def test_ssp_reads_hold_every_update_older_than_the_bound_and_all_that_arrived(
        pools: Any) -> None:
    # Ho et al.'s SSP: a read for clock c holds every update of clocks ≤ c − s − 1 and every
    # update applied before it (own previous clock included); nobody pushes beyond c + s
    steps, s, workers = 10, 1, 2
    # staleness_lr="none": every applied update raises its slot by the full lr, which is
    # how _present sees it (the staleness-aware rate would apply late ones at lr/τ)
    results = pools(3).run(ps_train, 1, steps, 1, model_name="counter", opt="plain-sgd",
                           mode="ssp", staleness=s, straggler={1: 5.0}, compute_s=0.01,
                           record_reads=True, staleness_lr="none")
    ran_ahead = 0
    for w, worker in enumerate(_workers(results)):
        for c, read in enumerate(worker["reads"]):
            present = _present(read, workers)
            old = {(k, v) for k in range(c - s) for v in range(workers)}
            assert old <= present, (w, c, sorted(old - present))
            assert {(k, w) for k in range(c)} <= present, (w, c)  # read-my-writes
            assert all(k < c if v == w else k <= c + s for k, v in present), (w, c, present)
            ran_ahead += c >= s and (c - s, 1 - w) not in present  # the other: s behind
    assert ran_ahead > 0  # the straggler made the gate close: the test can see a breach
    hist = _staleness(results)
    assert hist.total == workers * steps  # one update per push, applied on arrival
    assert 0 < hist.max <= (workers - 1) * (2 * s + 1), hist  # the documented bound
    fast, slow = (w["report"] for w in _workers(results))
    assert slow.straggler_sleep_s > 0 == fast.straggler_sleep_s


def _linreg_loss(params: list[torch.Tensor]) -> float:
    model = make_linreg()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        x, y = linreg_batch(999, 400)  # held out: step 999 is never trained on
        return float(loss_of("linreg", model, x, y))


@pytest.mark.nccl_rules
def test_async_converges_and_records_staleness(pools: Any) -> None:
    steps = 25
    results = pools(3).run(ps_train, 1, steps, B, model_name="linreg", opt="plain-sgd",
                           mode="async", straggler={1: 4.0}, compute_s=0.005)
    hist = _staleness(results)
    assert hist.total == 2 * steps  # one update per worker step, applied on arrival
    assert hist.max > 0, hist  # the fast worker's updates land while the straggler computes
    start = _linreg_loss([p.detach() for p in make_linreg().parameters()])
    for worker in _workers(results):
        final = _linreg_loss(worker["params"])
        assert final < 0.02 * start, (start, final)
    assert _staleness(_sync_run(pools)).max == 0


@pytest.mark.nccl_rules
def test_sparse_embeddings_train_exactly_and_send_a_tenth_of_dense(pools: Any) -> None:
    steps, b = 3, 16
    sparse = pools(4).run(ps_train, 2, steps, b, model_name="clicks", sparse=True, mode="sync")
    dense = pools(4).run(ps_train, 2, steps, b, model_name="clicks", sparse=False, mode="sync")
    expected = reference("clicks", "sgd", steps, 2 * b)
    _assert_params(sparse, expected)
    _assert_params(dense, expected)

    def wire(results: list[dict[str, Any]]) -> int:
        return sum(w["loop_bytes"] for w in _workers(results))

    assert wire(sparse) * 10 <= wire(dense), (wire(sparse), wire(dense))


def test_checkpoint_restores_values_optimizer_state_and_clock(pools: Any, tmp_path: Any) -> None:
    first, rest = 3, 2
    saved = pools(3).run(ps_train, 1, first, B, opt="adam", mode="sync",
                         server_kwargs={"checkpoint_dir": str(tmp_path)})
    verify(str(tmp_path / "ps-server-000"))  # sealed as every disttrain checkpoint
    state = load_checkpoint(str(tmp_path / "ps-server-000"))
    assert (state["version"], state["clock"]) == (first, first)
    model = make_mlp()
    part = partition(specs_of(model), 1)
    params = _workers(saved)[0]["params"]
    assert torch.equal(state["values"], gather_flat(params, part, 0, part.total, torch.float64))
    resumed = pools(3).run(ps_train, 1, rest, B, opt="adam", mode="sync", start_clock=first,
                           server_kwargs={"restore_dir": str(tmp_path)})
    _assert_params(resumed, reference("mlp", "adam", first + rest, 2 * B))
