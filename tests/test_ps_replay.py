"""Asynchronous and bounded-staleness parameter servers checked exactly, not by convergence.

Each server records, per applied update, the worker that sent it, its clock and the
version of the server's values that worker had read (``record_updates``). One process
replays that record: worker w's gradient at clock c is recomputed on its batch (the rows
[w·b, (w+1)·b) of global batch c) from the values the record says it read (each server's
shard at that version), and every server's optimizer steps in the recorded order at the
staleness-scaled rate. The replay must give the servers' final parameters bit for bit.
A worker that computed on other values than it reported, an update dropped, applied twice,
applied at the wrong rate or to the wrong keys cannot pass.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from disttrain.parallel.parameter_server import partition
from disttrain.parallel.parameter_server.partition import gather_flat, scatter_flat, specs_of
from tests.ps_cases import MODELS, OPTIMIZERS, loss_of, ps_train, reference

STEPS, B = 6, 4
LATE_S = 0.5  # long enough for another worker's six steps, even on a loaded machine


def _grad(model_name: str, model: torch.nn.Module, part: Any, values: torch.Tensor,
          worker: int, clock: int, workers: int) -> torch.Tensor:
    """Worker ``worker``'s gradient at ``clock`` on the parameters ``values`` (flat)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        scatter_flat(params, part, 0, values)
    x, y = MODELS[model_name][1](clock, workers * B)
    x, y = x[worker * B:(worker + 1) * B], y[worker * B:(worker + 1) * B]
    model.zero_grad()
    loss_of(model_name, model, x, y).backward()
    return gather_flat([p.grad for p in params], part, 0, part.total, torch.float64)


def _inverse(staleness: int) -> float:
    """The staleness-aware rate (Zhang et al. 2016) for one contribution: 1/τ for τ > 1."""
    return 1.0 / staleness if staleness > 1 else 1.0


def replay(records: list[list[Any]], model_name: str, opt: str, workers: int) -> torch.Tensor:
    """The servers' final values (flat) from their update records, in one process."""
    make = MODELS[model_name][0]
    model = make()
    part = partition(specs_of(model), len(records))
    start = gather_flat(list(model.parameters()), part, 0, part.total, torch.float64)
    ranges = [part.server_range(s) for s in range(len(records))]
    history = [[start[a:b].clone()] for a, b in ranges]  # history[s][v]: version v of shard s
    shards = [torch.nn.Parameter(h[0].clone()) for h in history]
    optimizers = [OPTIMIZERS[opt]([p]) for p in shards]
    read: dict[tuple[int, int], list[int]] = {}  # (worker, clock) → version read per server
    for s, record in enumerate(records):
        for update in record:
            assert len(update.read) == 1 and update.worker >= 0, update  # one worker's push
            read.setdefault((update.worker, update.clock), [-1] * len(records))[s] = \
                update.read[0]
    done = [0] * len(records)
    while any(done[s] < len(r) for s, r in enumerate(records)):
        progressed = False
        for s, record in enumerate(records):
            while done[s] < len(record):
                worker, clock, _ = record[done[s]]
                versions = read[(worker, clock)]
                if any(v >= len(history[t]) for t, v in enumerate(versions)):
                    break  # it read a version another server has yet to produce here
                values = torch.cat([history[t][v] for t, v in enumerate(versions)])
                grad = _grad(model_name, model, part, values, worker, clock, workers)
                group = optimizers[s].param_groups[0]
                lr = group["lr"]
                group["lr"] = lr * _inverse(len(history[s]) - 1 - versions[s])
                shards[s].grad = grad[ranges[s][0]:ranges[s][1]].clone()
                optimizers[s].step()
                group["lr"] = lr
                history[s].append(shards[s].detach().clone())
                done[s] += 1
                progressed = True
        assert progressed, "the record reads versions no server ever applied"
    return torch.cat([h[-1] for h in history])


def late_start(comm: Any, worker: int, clock: int) -> None:
    """Worker 1 starts its first step late (after its PSWorker's first read of everything):
    the others' pushes land between that read and its first pull."""
    if (worker, clock) == (1, 0):
        time.sleep(LATE_S)


@pytest.mark.parametrize(("servers", "workers", "mode", "staleness", "late"), [
    (1, 2, "async", 0, True), (2, 2, "async", 0, False), (1, 3, "async", 0, False),
    (1, 2, "ssp", 1, False), (2, 2, "ssp", 2, False), (1, 3, "ssp", 2, False)])
def test_replaying_the_update_record_gives_the_servers_parameters_exactly(
        pools: Any, servers: int, workers: int, mode: str, staleness: int, late: bool) -> None:
    results = pools(servers + workers).run(
        ps_train, servers, STEPS, B, mode=mode, staleness=staleness, straggler={1: 3.0},
        compute_s=0.004, server_kwargs={"record_updates": True},
        hook=late_start if late else None)
    records = [r["updates"] for r in results if r["role"] == "server"]
    for record in records:  # every worker's every clock, once, on every server
        assert sorted((u.worker, u.clock) for u in record) == \
            [(w, c) for w in range(workers) for c in range(STEPS)]
    if late:  # the first pull, not the PSWorker's start-up read, is what clock 0 used
        assert next(u.read[0] for u in records[0] if (u.worker, u.clock) == (1, 0)) > 0
    else:  # the straggler's pushes land behind the others': not sync in disguise
        stale = [v - u.read[0] for record in records for v, u in enumerate(record)]
        assert max(stale) > 0, stale
    expected = replay(records, "mlp", "sgd", workers)
    final = torch.cat([r["values"] for r in results if r["role"] == "server"])
    torch.testing.assert_close(final, expected, rtol=0, atol=0)


def test_one_async_worker_is_sync_exactly(pools: Any) -> None:
    results = pools(2).run(ps_train, 1, STEPS, B, mode="async",
                           server_kwargs={"record_updates": True})
    (server,) = (r for r in results if r["role"] == "server")
    assert [u.read for u in server["updates"]] == [(c,) for c in range(STEPS)]  # never stale
    worker = next(r for r in results if r["role"] == "worker")
    for got, want in zip(worker["params"], reference("mlp", "sgd", STEPS, B), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
