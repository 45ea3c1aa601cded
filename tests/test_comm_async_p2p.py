"""Asynchronous collectives run in call order; point-to-point messages reach the right buffers
whatever the posting order, for every dtype, even beside a collective in flight."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch

from disttrain.comm import CommConfig, CommError, CommTimeoutError, Communicator


def _sibling(comm: Communicator, **config: Any) -> Communicator:
    """Another communicator on the pool's transport (every rank makes one, so tags agree);
    ``close()`` on it must leave the shared transport open."""
    config.setdefault("timeout_s", comm.config.timeout_s)
    return Communicator(comm.transport, CommConfig(**config), owns_transport=False)

# ----------------------------------------------------------------------------- async


def async_order(comm: Communicator, algorithm: str) -> dict[str, Any]:
    """sum, then prod, then max on one tensor: the result tells the execution order."""
    c = _sibling(comm)
    r = comm.rank
    t = torch.tensor([float(r + 1)], dtype=torch.float64)
    u = torch.tensor([float(r + 2)], dtype=torch.float64)
    works = [c.all_reduce(t, "sum", algorithm=algorithm, async_op=True),
             c.all_reduce(u, "prod", algorithm=algorithm, async_op=True),
             c.all_reduce(t, "prod", algorithm=algorithm, async_op=True),
             c.all_reduce(u, "min", algorithm=algorithm, async_op=True),
             c.all_reduce(t, "sum", algorithm=algorithm, async_op=True)]
    for i in (4, 0, 3, 1, 2):  # waiting order must not matter
        works[i].wait()  # type: ignore[union-attr]
    done = [w.is_completed() for w in works]  # type: ignore[union-attr]
    # a synchronous call queues behind pending async ones
    v = torch.tensor([float(r + 1)], dtype=torch.float64)
    pending = c.all_reduce(v, "sum", algorithm=algorithm, async_op=True)
    c.all_reduce(v, "prod", algorithm=algorithm)
    after_sync = pending.is_completed()  # type: ignore[union-attr]
    pending.wait()  # type: ignore[union-attr]
    seqs = [rec["seq"] for rec in c.flight_recorder.dump()]
    c.close()
    return {"t": t.item(), "u": u.item(), "v": v.item(), "done": done,
            "after_sync": after_sync, "seqs": seqs}


@pytest.mark.parametrize("algorithm", ["ring", "naive", "native"])
def test_async_collectives_run_in_call_order(pools, algorithm):
    p = 3
    s = p * (p + 1) / 2  # sum of r + 1
    t = p * s**p  # sum, then prod (s ** p), then sum again
    u = math.prod(r + 2 for r in range(p))  # prod, then min of equal values
    v = s**p  # async sum, then sync prod
    for rank, res in enumerate(pools(p).run(async_order, algorithm)):
        assert res["t"] == t and res["u"] == u and res["v"] == v, f"rank {rank}: {res}"
        assert res["done"] == [True] * 5 and res["after_sync"], f"rank {rank}"
        assert res["seqs"] == list(range(1, 8))


def not_completed_until_peer_joins(comm: Communicator) -> list[bool]:
    """Rank 1 joins only after rank 0 has looked: completion is impossible before."""
    c = _sibling(comm)
    t = torch.ones(1000)
    token = torch.zeros(1)
    seen = []
    if comm.rank == 0:
        work = c.all_reduce(t, algorithm="ring", async_op=True)
        seen.append(work.is_completed())  # type: ignore[union-attr]
        c.send(token, 1, tag=77)  # now rank 1 may start
        work.wait()  # type: ignore[union-attr]
        seen.append(work.is_completed())  # type: ignore[union-attr]
    else:
        c.recv(token, 0, tag=77)
        c.all_reduce(t, algorithm="ring")
    c.close()
    return [*seen, t[0].item() == 2.0]


def test_is_completed_reports_pending_then_done(pools):
    rank0, rank1 = pools(2).run(not_completed_until_peer_joins)
    assert rank0 == [False, True, True]
    assert rank1 == [True]


def async_error(comm: Communicator) -> dict[str, Any]:
    c = _sibling(comm, debug_checks=True)
    work = c.all_reduce(torch.ones(4 + comm.rank), async_op=True)  # sizes differ: an error
    try:
        work.wait()  # type: ignore[union-attr]
        message = ""
    except ValueError as exc:
        message = f"{type(exc).__name__}: {exc}"
    t = torch.ones(2)
    c.all_reduce(t, async_op=True).wait()  # type: ignore[union-attr]
    c.close()
    return {"message": message, "after": t.tolist(),
            "states": [r["state"] for r in c.flight_recorder.dump()]}


def test_async_error_surfaces_on_wait_naming_the_op(pools):
    for rank, res in enumerate(pools(2).run(async_error)):
        assert res["message"].startswith("CollectiveMismatchError"), f"rank {rank}"
        assert "all_reduce #1" in res["message"] and "element count" in res["message"]
        assert res["after"] == [2.0, 2.0]
        assert res["states"] == ["failed", "completed"]


# ----------------------------------------------------------------------------- point to point

DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64"]


def _payload(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    values = torch.randint(-100, 100, (n,), generator=torch.Generator().manual_seed(seed))
    if dtype == torch.bool:
        return values > 0
    if dtype == torch.uint8:
        return values.abs().to(dtype)
    return values.to(dtype)


def p2p_tags_and_dtypes(comm: Communicator) -> list[str]:
    """Rank 0 sends; rank 1 posts its receives in another order and waits in a third."""
    c = _sibling(comm)
    errors = []
    sizes = {"a": 5, "b": 1000, "c": 0, "d": 70000}
    tags = {"a": 1, "b": 2, "c": 3, "d": 4}
    if comm.rank == 0:
        works = [c.isend(_payload(torch.float32, n, tags[k]), 1, tag=tags[k])
                 for k, n in sizes.items()]
        for w in works:
            w.wait()
    else:
        bufs = {k: torch.full((n,), -1.0) for k, n in sizes.items()}
        order = ["d", "c", "a", "b"]
        works = {k: c.irecv(bufs[k], 0, tag=tags[k]) for k in order}
        for k in ["b", "d", "a", "c"]:
            works[k].wait()
        for k, n in sizes.items():
            if not torch.equal(bufs[k], _payload(torch.float32, n, tags[k])):
                errors.append(f"tag {tags[k]} landed in the wrong buffer")
    for i, name in enumerate(DTYPES):  # every dtype, both directions
        dtype = getattr(torch, name)
        for src in (0, 1):
            expected = _payload(dtype, 257, 100 * i + src)
            if comm.rank == src:
                c.send(expected, 1 - src, tag=10 + i)
            else:
                got = torch.zeros(257, dtype=dtype)
                c.recv(got, src, tag=10 + i)
                if not torch.equal(got, expected):
                    errors.append(f"{name} from rank {src} arrived changed")
    snap = c.stats.snapshot()
    side = "send" if comm.rank == 0 else "recv"  # the side of the tagged messages
    payload = sum(sizes.values()) * 4 + sum(
        257 * torch.empty(0, dtype=getattr(torch, d)).element_size() for d in DTYPES)
    way = "sent" if side == "send" else "recv"
    expected = {"calls": 4 + len(DTYPES), f"bytes_{way}": payload,
                f"msgs_{way}": 3 + len(DTYPES)}  # the zero-length message is not sent
    if {k: snap[side][k] for k in expected} != expected:
        errors.append(f"{side} counters {snap[side]} != {expected}")
    c.close()
    return errors


def test_p2p_tags_reach_the_right_buffers_for_every_dtype(pools):
    errors = [e for rank_errors in pools(2).run(p2p_tags_and_dtypes) for e in rank_errors]
    assert not errors, errors


def zero_length_p2p(comm: Communicator) -> dict[str, Any]:
    c = _sibling(comm)
    peer = 1 - comm.rank
    empty = torch.empty(0, dtype=torch.int64)
    work = c.isend(empty, peer, tag=5) if comm.rank == 0 else c.irecv(empty, peer, tag=5)
    work.wait()
    c.send(torch.tensor([41]), peer, tag=6) if comm.rank == 0 else None
    got = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 1:
        c.recv(got, peer, tag=6)
    return {"done": work.is_completed(), "got": got.item(), "stats": c.stats.snapshot()}


def test_zero_length_messages_complete_and_move_no_bytes(pools):
    rank0, rank1 = pools(2).run(zero_length_p2p)
    assert rank0["done"] and rank1["done"]
    assert rank1["got"] == 41  # the next message on the link is not disturbed
    assert rank0["stats"]["send"]["calls"] == 2 and rank0["stats"]["send"]["bytes_sent"] == 8
    assert rank1["stats"]["recv"]["calls"] == 2 and rank1["stats"]["recv"]["bytes_recv"] == 8


def p2p_beside_async_collective(comm: Communicator) -> list[str]:
    """Ring neighbours exchange with user tags 0 while an all_reduce streams in many chunks."""
    c = _sibling(comm, chunk_bytes=4096)
    p, r = comm.world_size, comm.rank
    big = torch.full((50000,), float(r))
    work = c.all_reduce(big, algorithm="ring", async_op=True)
    errors = []
    for round_ in range(5):
        outgoing = torch.full((300,), float(100 * r + round_))
        got = torch.full((300,), -1.0)
        pending = [c.irecv(got, (r - 1) % p, tag=0), c.isend(outgoing, (r + 1) % p, tag=0)]
        for w in pending:
            w.wait()
        if not torch.equal(got, torch.full((300,), float(100 * ((r - 1) % p) + round_))):
            errors.append(f"rank {r} round {round_}: p2p message mixed with the collective")
    work.wait()  # type: ignore[union-attr]
    if not torch.equal(big, torch.full((50000,), float(sum(range(p))))):
        errors.append(f"rank {r}: all_reduce mixed with point-to-point")
    c.close()
    return errors


@pytest.mark.parametrize("p", [2, 3])
def test_p2p_concurrent_with_async_collective_does_not_mix(pools, p):
    errors = [e for rank_errors in pools(p).run(p2p_beside_async_collective) for e in rank_errors]
    assert not errors, errors


def polled_p2p(comm: Communicator) -> dict[str, Any]:
    """Each rank posts a message and only polls ``is_completed()`` (bounded) until it turns
    True, as a loop that computes between polls would; then ``wait()`` returns at once."""
    c = _sibling(comm)
    peer = 1 - comm.rank
    payload = torch.arange(1000, dtype=torch.float32) + 7 * comm.rank
    got = torch.zeros(1000)
    works = [c.isend(payload, peer, tag=3), c.irecv(got, peer, tag=3)]
    deadline = time.monotonic() + 20
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.001)
    polled = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    c.close()
    return {"polled": polled,
            "got": torch.equal(got, torch.arange(1000, dtype=torch.float32) + 7 * peer)}


def test_polling_is_completed_sees_messages_finish(pools):
    """Gloo's point-to-point work never reports completion before a wait(): polling alone
    would spin for ever."""
    for rank, res in enumerate(pools(2).run(polled_p2p)):
        assert res == {"polled": [True, True], "got": True}, f"rank {rank}: {res}"


def polled_then_timed_out(comm: Communicator) -> dict[str, Any]:
    """Rank 1 polls a receive, then waits 0.3 s for it: the sender holds it back until
    after that wait failed. A later wait() still sees it arrive; the communicator is
    failed meanwhile (the message moved after its wait gave up)."""
    c = _sibling(comm)
    got = torch.zeros(4)
    out: dict[str, Any] = {}
    if comm.rank == 1:
        work = c.irecv(got, 0, tag=9)
        out["first_poll"] = work.is_completed()
        try:
            work.wait(timeout=0.3)
        except CommTimeoutError as exc:
            out["error"] = (str(exc), exc.op, exc.peer)
        comm.barrier()
        work.wait()
        out["got"] = got.tolist()
        try:
            c.barrier()
        except CommError as exc:
            out["after"] = str(exc)
    else:
        comm.barrier()
        c.send(torch.full((4,), 5.0), 1, tag=9)
    c.close()
    return out


def test_a_polled_receive_times_out_naming_its_peer_and_still_lands(pools):
    _, res = pools(2).run(polled_then_timed_out)
    assert res["first_poll"] is False
    text, op, peer = res["error"]
    assert (op, peer) == ("recv", 0)
    assert "timed out after 0.3s waiting to recv from rank 0" in text, text
    assert res["got"] == [5.0] * 4
    assert "failed earlier" in res["after"] and "timed out after 0.3s" in res["after"], \
        res["after"]
