"""Nothing hangs: a missing peer, a dead rank or a size mismatch ends in a named error within
the timeout, and a failed communicator refuses further use.

These tests break their process group, so each starts fresh processes (``run_fresh``).
A rank that must die (SIGKILL, or Gloo's abort on a size mismatch) runs in a forked child
of its harness process, so the harness still gets an answer from every rank.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disttrain.comm import CommConfig, CommError, Communicator
from tests.dist import run_fresh, wait_until_posts_refused

TIMEOUT_S = 2.0
NO_HANG_S = 10 * TIMEOUT_S  # a loose bound: a no-hang check, not a speed assertion


def _init(rank: int, world_size: int, store: str) -> Communicator:
    """Gloo with a patient rendezvous (ranks may start seconds apart on a loaded machine)
    and a communicator with a short timeout."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    return Communicator.from_torch(config=CommConfig(timeout_s=TIMEOUT_S))


def _describe(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": str(exc), "op": getattr(exc, "op", None),
            "seq": getattr(exc, "seq", None), "peer": getattr(exc, "peer", None),
            "suspects": list(getattr(exc, "suspects", ()))}


def _signal_done(store: str, rank: int) -> None:
    Path(f"{store}.done{rank}").touch()


def _wait_done(store: str, ranks: list[int], limit_s: float = 60.0) -> None:
    """Stay alive (outside any collective) until the given ranks have finished."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and not all(
            os.path.exists(f"{store}.done{r}") for r in ranks):
        time.sleep(0.05)


def _after_failure(comm: Communicator) -> dict[str, Any]:
    """What the failed communicator says when used again."""
    try:
        comm.all_reduce(torch.ones(3))
    except CommError as exc:
        return _describe(exc)
    return {"type": None}


def skipped_collective(rank: int, world_size: int, store: str) -> dict[str, Any] | None:
    """Rank 1 stays alive but skips all_reduce #3; rank 0 runs it async, rank 2 sync."""
    comm = _init(rank, world_size, store)
    t = torch.ones(1000)
    comm.all_reduce(t, algorithm="ring")
    comm.all_reduce(t, algorithm="ring")
    if rank == 1:
        _wait_done(store, [0, 2])
        return None
    start = time.monotonic()
    try:
        if rank == 0:
            comm.all_reduce(t, algorithm="ring", async_op=True).wait()
        else:
            comm.all_reduce(t, algorithm="ring")
        result: dict[str, Any] = {"type": None}
    except CommError as exc:
        result = _describe(exc)
    result["elapsed"] = time.monotonic() - start
    result["after"] = _after_failure(comm)
    result["records"] = comm.flight_recorder.dump()
    _signal_done(store, rank)
    return result


def test_skipped_collective_times_out_naming_op_seq_and_peer():
    results = run_fresh(skipped_collective, 3, timeout_s=120)
    assert results[1] is None
    for rank, left in ((0, 2), (2, 1)):  # the ring neighbour each rank receives from
        res = results[rank]
        assert res["type"] == "CommTimeoutError", res
        assert (res["op"], res["seq"], res["peer"]) == ("all_reduce", 3, left), res
        assert f"all_reduce #3 (ring) on rank {rank}" in res["message"]
        assert f"from rank {left}" in res["message"]
        assert res["suspects"] == [1] and "[1]" in res["message"]  # the real culprit
        assert res["elapsed"] < NO_HANG_S
        assert res["after"]["type"] == "CommError"
        assert "failed earlier and cannot be used again" in res["after"]["message"]
        assert "all_reduce #3" in res["after"]["message"]
        states = [(r["seq"], r["state"]) for r in res["records"]]
        assert states == [(1, "completed"), (2, "completed"), (3, "failed")]
        assert res["records"][2]["error"].startswith("CommTimeoutError: all_reduce #3")


def unmatched_recv(rank: int, world_size: int, store: str) -> dict[str, Any] | None:
    """Rank 1 stays alive but never sends; then it skips a native all_reduce on a second
    communicator (torch.distributed itself does not say who is late there)."""
    comm = _init(rank, world_size, store)
    second = Communicator(comm.transport, comm.config, owns_transport=False)
    if rank == 1:
        _wait_done(store, [0])
        return None
    results = {}
    for name, call in (("recv", lambda: comm.recv(torch.zeros(10), 1, tag=9)),
                       ("native", lambda: second.all_reduce(torch.ones(4), algorithm="native"))):
        start = time.monotonic()
        try:
            call()
            result: dict[str, Any] = {"type": None}
        except CommError as exc:
            result = _describe(exc)
        result["elapsed"] = time.monotonic() - start
        results[name] = result
    results["after"] = _after_failure(comm)
    _signal_done(store, rank)
    return results


def test_recv_without_send_and_skipped_native_collective_time_out_naming_the_peer():
    res = run_fresh(unmatched_recv, 2, timeout_s=120)[0]
    recv, native = res["recv"], res["native"]
    assert recv["type"] == "CommTimeoutError", recv
    assert (recv["op"], recv["seq"], recv["peer"], recv["suspects"]) == ("recv", 1, 1, [1])
    assert "recv #1" in recv["message"] and "from rank 1" in recv["message"]
    assert recv["elapsed"] < NO_HANG_S
    # the receive may still land later: the communicator must not be reused
    assert res["after"]["type"] == "CommError"
    assert native["type"] == "CommTimeoutError", native
    assert (native["op"], native["seq"], native["suspects"]) == ("all_reduce", 1, [1])
    assert "all_reduce #1 (native)" in native["message"] and "[1]" in native["message"]
    assert native["elapsed"] < NO_HANG_S


# ----------------------------------------------------------------------------- dying ranks


def _in_child(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """Run ``fn`` in a forked child; return its exit code and JSON result (None if it died)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the harness
        os.close(read)
        try:
            os.write(write, json.dumps(fn(*args)).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return {"exit": os.waitstatus_to_exitcode(status),
            "result": json.loads(data) if data else None}


def _killed_mid_sequence(rank: int, world_size: int, store: str, victim: int,
                         algorithm: str) -> dict[str, Any]:
    comm = _init(rank, world_size, store)
    t = torch.ones(50000)
    start = time.monotonic()
    try:
        for step in range(20):
            if rank == victim and step == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_reduce(t, algorithm=algorithm)
        result: dict[str, Any] = {"type": None}
    except CommError as exc:
        result = _describe(exc)
    result["elapsed"] = time.monotonic() - start
    result["after"] = _after_failure(comm)
    return result


def killed_mid_sequence(rank: int, world_size: int, store: str, victim: int,
                        algorithm: str) -> dict[str, Any]:
    import torch.distributed  # noqa: F401 - imported once here, before the fork

    return _in_child(_killed_mid_sequence, rank, world_size, store, victim, algorithm)


def _check_survivors(results: list[dict[str, Any]], victim: int) -> None:
    for rank, res in enumerate(results):
        if rank == victim:
            assert res["exit"] == -signal.SIGKILL and res["result"] is None
            continue
        err = res["result"]
        assert err["type"] in ("CommTimeoutError", "PeerFailedError"), (rank, err)
        assert err["op"] == "all_reduce" and err["seq"] >= 5, (rank, err)
        assert victim in err["suspects"] or err["peer"] == victim, (rank, err)
        assert f"rank {victim}" in err["message"] or f"[{victim}]" in err["message"]
        assert err["elapsed"] < NO_HANG_S, (rank, err)
        assert err["after"]["type"] == "CommError", (rank, err)


def test_killed_rank_is_named_by_the_survivors_ring():
    # rank 0 does not talk to rank 1 directly in the ring: it must still name it
    _check_survivors(run_fresh(killed_mid_sequence, 3, 1, "ring", timeout_s=120), 1)


def test_killed_rank_is_named_by_the_survivors_native():
    _check_survivors(run_fresh(killed_mid_sequence, 2, 0, "native", timeout_s=120), 0)


def _post_to_the_dead(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Rank 1 dies between two collectives; rank 0 starts the next one only once Gloo
    refuses to post to rank 1 at all (checked on the raw process group, on a tag nothing
    else uses), so the collective fails when posting, not when waiting."""
    comm = _init(rank, world_size, store)
    comm.all_reduce(torch.ones(4), algorithm="ring")
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    refused = wait_until_posts_refused(1)
    # a single message to it fails at once (no check-in round, whose grace would be 30 s
    # with this timeout), and its communicator stays usable
    from disttrain.comm.cost_model import LinkCosts
    from disttrain.comm.transports.torch_p2p import TorchTransport

    patient = Communicator(TorchTransport(), CommConfig(timeout_s=60), costs=LinkCosts())
    p2p = []
    for _ in range(2):
        try:
            patient.isend(torch.ones(4), 1)
            p2p.append({"type": None})
        except CommError as exc:
            p2p.append(_describe(exc))
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), algorithm="ring")
        result: dict[str, Any] = {"type": None}
    except CommError as exc:
        result = _describe(exc)
    result.update(refused=refused, elapsed=time.monotonic() - start,
                  after=_after_failure(comm), p2p=p2p)
    return result


def post_to_the_dead(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch.distributed  # noqa: F401 - imported once here, before the fork

    return _in_child(_post_to_the_dead, rank, world_size, store)


def test_a_collective_that_cannot_even_post_to_a_dead_rank_names_it():
    """Gloo raises from send/recv themselves once a connection broke. That error must come
    out as the same named PeerFailedError as a failed wait, not as Gloo's RuntimeError."""
    survivor, victim = run_fresh(post_to_the_dead, 2, timeout_s=120)
    assert victim["exit"] == -signal.SIGKILL and victim["result"] is None
    err = survivor["result"]
    assert survivor["exit"] == 0 and err is not None, survivor  # None: an unnamed error
    assert err["refused"], "Gloo kept accepting posts to the dead rank for 30 s"
    assert err["type"] == "PeerFailedError", err
    assert (err["op"], err["seq"], err["peer"], err["suspects"]) == ("all_reduce", 2, 1, [1])
    assert "all_reduce #2 (ring) on rank 0" in err["message"], err
    assert "starting to" in err["message"] and "rank 1" in err["message"], err
    assert err["elapsed"] < NO_HANG_S
    assert err["after"]["type"] == "CommError"
    for p2p in err["p2p"]:  # the second try too: a refused message does not poison
        assert p2p["type"] == "PeerFailedError", p2p
        assert (p2p["op"], p2p["peer"]) == ("send", 1) and "starting to send" in p2p["message"]
        # no check-in round (it would have waited 30.5 s): nobody was asked, nobody suspected
        assert p2p["suspects"] == [] and "check in" not in p2p["message"], p2p


def _size_mismatch(rank: int, world_size: int, store: str) -> dict[str, Any]:
    comm = _init(rank, world_size, store)
    t = torch.ones(1000 + 10 * rank)  # no debug checks: nothing compares sizes up front
    start = time.monotonic()
    try:
        comm.all_reduce(t, algorithm="ring")
        result: dict[str, Any] = {"type": None}
    except CommError as exc:
        result = _describe(exc)
    result["elapsed"] = time.monotonic() - start
    return result


def size_mismatch(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch.distributed  # noqa: F401 - imported once here, before the fork

    return _in_child(_size_mismatch, rank, world_size, store)


def test_size_mismatch_without_debug_checks_does_not_hang():
    """Gloo aborts the rank that receives more bytes than it posted ("Received data size
    doesn't match expected size"); no Python code can catch that. The other rank must get
    a named error that points at the dead rank and at debug_checks=True."""
    rank0, rank1 = run_fresh(size_mismatch, 2, timeout_s=120)
    assert rank0["exit"] == -signal.SIGABRT and rank0["result"] is None
    err = rank1["result"]
    assert err["type"] == "PeerFailedError", err
    assert err["peer"] == 0 and err["suspects"] == [0]
    assert "all_reduce #1" in err["message"] and "debug_checks=True" in err["message"]
    assert err["elapsed"] < NO_HANG_S


def group_without_a_member(rank: int, world_size: int, store: str) -> dict[str, Any] | None:
    """Rank 1 never calls new_group([0, 1]); rank 0 does."""
    comm = _init(rank, world_size, store)
    if rank == 1:
        _wait_done(store, [0])
        return None
    start = time.monotonic()
    try:
        comm.new_group([0, 1])
        result: dict[str, Any] = {"type": None}
    except CommError as exc:
        result = _describe(exc)
    result["elapsed"] = time.monotonic() - start
    result["after"] = _after_failure(comm)
    _signal_done(store, rank)
    return result


def test_new_group_without_a_member_times_out_naming_it():
    res = run_fresh(group_without_a_member, 2, timeout_s=120)[0]
    assert res["type"] == "CommTimeoutError", res
    assert (res["op"], res["peer"], res["suspects"]) == ("new_group", 1, [1]), res
    assert res["message"].startswith("new_group #0 (setup) on rank 0: timed out after 2s "
                                     "agreeing on group [0, 1] with rank 1"), res["message"]
    assert "rank(s) [1] did not check in afterwards" in res["message"]
    assert res["elapsed"] < NO_HANG_S
    assert res["after"]["type"] == "CommError"  # a late set-up message could still arrive
    assert "failed earlier" in res["after"]["message"]


def _outlive_a_peer(rank: int, world_size: int, store: str) -> dict[str, Any]:
    """Rank 2 waits for messages from ranks 0 and 1 (patient 60 s timeout, no check-in);
    rank 1 dies. Rank 2 names it at once, rank 0's message still lands, the pair with rank 0
    still works both ways, a collective refuses at once, and a group without rank 1 works."""
    from disttrain.comm.cost_model import LinkCosts
    from disttrain.comm.transports.torch_p2p import TorchTransport

    _init(rank, world_size, store)
    comm = Communicator(TorchTransport(), CommConfig(timeout_s=60), costs=LinkCosts())
    out: dict[str, Any] = {}
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        time.sleep(2.0)  # after rank 1's death
        comm.send(torch.full((3,), 7.0), 2, tag=5)
        back = torch.zeros(3)
        comm.recv(back, 2, tag=6)
        out["back"] = back.tolist()
    if rank == 2:
        from_0, from_1 = torch.zeros(3), torch.zeros(3)
        work_0 = comm.irecv(from_0, 0, tag=5, check_in=False)
        work_1 = comm.irecv(from_1, 1, tag=5, check_in=False)
        start = time.monotonic()
        try:
            work_1.wait()
        except CommError as exc:
            out["lost"] = _describe(exc)
        out["lost_after_s"] = time.monotonic() - start
        work_0.wait()
        out["from_0"] = from_0.tolist()
        comm.send(torch.full((3,), 9.0), 0, tag=6)
        out["failed"] = comm.failed
        out["collective"] = _after_failure(comm)
        try:
            comm.isend(torch.ones(1), 1)
        except CommError as exc:
            out["to_dead"] = str(exc)
    group = comm.new_group([0, 2])
    assert group is not None
    total = torch.full((1,), float(rank))
    group.all_reduce(total)
    out["sum"] = total.item()
    group.close()
    comm.close()
    return out


def outlive_a_peer(rank: int, world_size: int, store: str) -> dict[str, Any]:
    import torch.distributed  # noqa: F401 - imported once here, before the fork

    return _in_child(_outlive_a_peer, rank, world_size, store)


def test_a_broken_pair_leaves_the_others_usable():
    first, victim, third = run_fresh(outlive_a_peer, 3, timeout_s=120)
    assert victim["exit"] == -signal.SIGKILL
    assert first["result"] == {"back": [9.0] * 3, "sum": 2.0}, first
    out = third["result"]
    assert out["lost"]["type"] == "PeerFailedError" and out["lost"]["peer"] == 1, out
    assert "check in" not in out["lost"]["message"], out  # named at once, nobody asked
    assert out["lost_after_s"] < NO_HANG_S, out  # not the 30.5 s check-in round
    assert out["from_0"] == [7.0] * 3 and out["sum"] == 2.0 and out["failed"], out
    assert out["collective"]["type"] == "CommError", out  # it would involve rank 1
    assert "cannot be used again with rank 1" in out["collective"]["message"], out
    assert "cannot be used again with rank 1" in out["to_dead"], out
