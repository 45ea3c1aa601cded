"""Failures on the shared-memory transport: a rank SIGKILLed mid-collective is named by the
survivors well within the timeout, a live rank that never arrives is named at the timeout,
and no segment is ever left in /dev/shm.

``tests.dist.run_fresh`` stops at the first dead rank, but here the survivors' errors are
the point, so a small launcher below collects every rank's outcome, dead or alive. Cases
where every rank lives run in the shared pool on throw-away transports.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.dist import (
    adopt_environment,
    environment,
    init_gloo,
    rank_context,
    wait_until_posts_refused,
)

SHM_PREFIX = "/dev/shm/"


def _rank_main(rank: int, world_size: int, store: str, conn: Any,
               fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]) -> None:
    adopt_environment(env)
    try:
        conn.send(("ok", fn(rank, world_size, store, *args)))
    except BaseException:
        conn.send(("err", traceback.format_exc()))


def run_all(fn: Callable[..., Any], world_size: int, *args: Any,
            timeout_s: float = 120.0) -> list[tuple[str, Any]]:
    """``fn(rank, world_size, store, *args)`` on fresh ranks; per rank ("ok", value),
    ("err", traceback) or ("died", exit code)."""
    ctx = rank_context()
    with tempfile.TemporaryDirectory(prefix="disttrain-test-") as tmp:
        procs, conns = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, daemon=True,
                               args=(rank, world_size, os.path.join(tmp, "store"), child, fn,
                                     args, environment()))
            proc.start()
            child.close()
            procs.append(proc)
            conns.append(parent)
        outcomes: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(outcomes) < world_size and time.monotonic() < deadline:
            mpc.wait([c for r, c in enumerate(conns) if r not in outcomes], timeout=0.5)
            for rank, (conn, proc) in enumerate(zip(conns, procs, strict=True)):
                if rank in outcomes:
                    continue
                if conn.poll():
                    try:
                        outcomes[rank] = conn.recv()
                    except EOFError:
                        outcomes[rank] = ("died", proc.exitcode)
                elif not proc.is_alive():
                    outcomes[rank] = ("died", proc.exitcode)
        for rank, proc in enumerate(procs):
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
            if outcomes.get(rank, ("",))[0] == "died":
                outcomes[rank] = ("died", proc.exitcode)
    return [outcomes.get(r, ("hung", None)) for r in range(world_size)]


def _shm_comm(rank: int, world_size: int, store: str, timeout_s: float) -> Any:
    from disttrain.comm import CommConfig, Communicator
    from disttrain.comm.transports import SharedMemoryTransport, ShmConfig

    init_gloo(rank, world_size, store, comm_timeout_s=30.0)  # the rendezvous's own timeout
    config = ShmConfig(slot_bytes=64 << 10, mailbox_slot_bytes=16 << 10)
    return Communicator(SharedMemoryTransport(config=config), CommConfig(timeout_s=timeout_s))


def die_mid_collective(rank: int, world_size: int, store: str, timeout_s: float,
                       algorithm: str) -> dict[str, Any]:
    """The last rank SIGKILLs itself inside a multi-round all_reduce (at its 3rd barrier
    for ``shm``; for ``ring``, at its 2nd message: after the reduce-scatter, before the
    all-gather); the others report what they saw."""
    comm = _shm_comm(rank, world_size, store, timeout_s)
    name = comm.transport.segment_name
    comm.all_reduce(torch.ones(10), algorithm=algorithm)  # everyone alive and connected
    if rank == world_size - 1:
        _kill_self_later(comm.transport, algorithm)
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(200_000), algorithm=algorithm)  # 800 KB: many rounds
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - start,
                "name": name}
    return {"error": None, "elapsed": time.monotonic() - start, "name": name}


def _kill_self_later(transport: Any, algorithm: str) -> None:
    calls = [0]
    target = transport.collectives if algorithm == "shm" else transport.mailboxes
    method = "step" if algorithm == "shm" else "isend"
    original = getattr(target, method)

    def dying(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == (3 if algorithm == "shm" else 2):
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    setattr(target, method, dying)


def _check_survivors(outcomes: list[tuple[str, Any]], timeout_s: float) -> None:
    assert outcomes[-1][0] == "died" and outcomes[-1][1] == -signal.SIGKILL, outcomes[-1]
    dead = len(outcomes) - 1
    for status, value in outcomes[:-1]:
        assert status == "ok", value
        assert value["error"] is not None, "a survivor finished a collective with a dead rank"
        assert value["error"].startswith("PeerFailedError"), value["error"]
        assert f"rank {dead}" in value["error"]
        assert value["elapsed"] < timeout_s / 2, value  # found by liveness, not the timeout
        assert not os.path.exists(SHM_PREFIX + value["name"]), "segment leaked in /dev/shm"


def test_rank_killed_mid_shm_collective_is_named_by_survivors():
    timeout_s = 30.0
    _check_survivors(run_all(die_mid_collective, 3, timeout_s, "shm"), timeout_s)


def test_rank_killed_mid_ring_over_shm_messages_is_named_by_survivors():
    timeout_s = 30.0
    _check_survivors(run_all(die_mid_collective, 2, timeout_s, "ring"), timeout_s)


# ------------------------------------------------------- a rank missing at set-up
def setup_without_a_peer(rank: int, world_size: int, store: str, mode: str) -> Any:
    """Rank 0 creates a shared-memory transport (set-up timeout 2 s) while rank 1 does not:
    it never starts ("absent"), exchanges host keys and then stops ("after-host-keys", so
    rank 0 has created the segment when the name cannot be sent), or dies ("dead")."""
    from disttrain.comm.transports import SharedMemoryTransport
    from disttrain.comm.transports.shm.segment import check_same_host

    comm = init_gloo(rank, world_size, store, comm_timeout_s=30.0)
    comm.all_reduce(torch.ones(1))  # connected
    if rank == 1:
        if mode == "dead":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "after-host-keys":
            check_same_host(None, 30.0)
        deadline = time.monotonic() + 60  # alive, elsewhere, until rank 0 has its answer
        while not os.path.exists(store + ".done") and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    refused = wait_until_posts_refused(1) if mode == "dead" else None
    before = set(os.listdir(SHM_PREFIX))
    start = time.monotonic()
    try:
        SharedMemoryTransport(timeout_s=2.0)
        result: dict[str, Any] = {"type": None}
    except Exception as exc:
        result = {"type": type(exc).__name__, "message": str(exc),
                  "suspects": list(getattr(exc, "suspects", ()))}
    result.update(elapsed=time.monotonic() - start, refused=refused,
                  new_files=sorted(set(os.listdir(SHM_PREFIX)) - before))
    open(store + ".done", "w").close()
    return result


@pytest.mark.parametrize("mode, error, step", [
    ("absent", "CommTimeoutError", "exchanging host keys timed out after 2s"),
    ("after-host-keys", "CommTimeoutError", "sending the segment's name timed out after 2s"),
    ("dead", "PeerFailedError", "exchanging host keys: a connection broke"),
])
def test_a_rank_missing_at_set_up_is_named_and_leaves_no_segment(mode, error, step):
    outcomes = run_all(setup_without_a_peer, 2, mode)
    status, res = outcomes[0]
    assert status == "ok", res
    assert res["type"] == error, res
    assert res["message"].startswith(f"shared-memory transport set-up on global rank 0: "
                                     f"{step}"), res["message"]
    assert res["suspects"] == [1] and "global ranks [1] did not check in" in res["message"]
    assert res["elapsed"] < 30, res  # the set-up timeout plus the check-in, not Gloo's own
    assert res["new_files"] == [], "a segment was left in /dev/shm"
    if mode == "dead":
        assert res["refused"] and outcomes[1] == ("died", -signal.SIGKILL), outcomes
    else:
        assert outcomes[1] == ("ok", None), outcomes


# ------------------------------------------------------- live ranks (in the shared pool)
def absent_or_closed(_comm: Any, mode: str) -> str:
    """On a throw-away transport (the pool's own stay usable), rank 1 stays alive but
    skips the collective ("absent") or closes its transport ("closed"); rank 0 reports."""
    from disttrain.comm import CommConfig, Communicator
    from disttrain.comm.transports import SharedMemoryTransport, ShmConfig

    transport = SharedMemoryTransport(config=ShmConfig(slot_bytes=4096, mailbox_slots=2,
                                                       mailbox_slot_bytes=4096))
    comm = Communicator(transport, CommConfig(timeout_s=1.0))
    comm.barrier(algorithm="shm")
    message = ""
    if transport.rank == 1:
        if mode == "closed":
            transport.close()
    else:
        try:
            comm.all_reduce(torch.ones(4), algorithm="shm")
            message = "no error"
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
    # rank 1 stays alive, out of the collective, until rank 0's has failed: over the pool's
    # own communicator, so an "absent" rank cannot close before rank 0 has timed out
    _comm.barrier()
    transport.close()
    return message


def test_absent_rank_is_named_at_the_timeout(pools):
    message = pools(2).run(absent_or_closed, "absent")[0]
    assert message.startswith("CommTimeoutError"), message
    assert "waiting for rank(s) [1]" in message


def test_closed_rank_is_named_as_failed(pools):
    message = pools(2).run(absent_or_closed, "closed")[0]
    assert message.startswith("PeerFailedError"), message
    assert "rank 1" in message and "closed its shared-memory transport" in message


def clean_close(_comm: Any) -> str:
    from disttrain.comm import Communicator
    from disttrain.comm.transports import SharedMemoryTransport

    transport = SharedMemoryTransport()
    comm = Communicator(transport)
    name = transport.segment_name
    assert not os.path.exists(SHM_PREFIX + name)  # unlinked as soon as everyone attached
    comm.all_reduce(torch.ones(3), algorithm="shm")
    comm.close()
    transport.close()  # idempotent, whether or not the communicator closed it
    return name


def test_no_segment_remains_after_normal_use(pools):
    names = set(pools(3).run(clean_close))
    assert len(names) == 1
    assert not os.path.exists(SHM_PREFIX + names.pop())
