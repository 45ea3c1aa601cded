"""Bytes and messages counted by the communicator match the theory of each algorithm, ring
streaming in small sub-chunks stays correct, and the flight recorder sees every collective.

The figures are the classic ones (Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp
2005): per rank, ring all-reduce sends 2(p−1)/p·V, naive (p−1)·V, recursive halving and
doubling 2(p−1)/p·V on a power of two.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from disttrain.comm import CommConfig, Communicator

BIG_CHUNK = 1 << 30  # one message per segment: message counts follow the step count alone


def _fresh(comm: Communicator, **config: Any) -> Communicator:
    """A communicator with clean counters on the pool's transport (every rank makes one, so
    tags agree); ``close()`` on it must leave the shared transport open."""
    config.setdefault("timeout_s", comm.config.timeout_s)
    return Communicator(comm.transport, CommConfig(**config), owns_transport=False)


def _inputs(p: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Integer-valued inputs: sums are exact in every dtype and in every order."""
    return [torch.randint(-5, 6, (n,), generator=torch.Generator().manual_seed(r)).to(dtype)
            for r in range(p)]


def all_reduce_traffic(comm: Communicator, algorithm: str, n: int, chunk_bytes: int,
                       dtype: str = "float32") -> dict[str, Any]:
    c = _fresh(comm, chunk_bytes=chunk_bytes)
    inputs = _inputs(comm.world_size, n, getattr(torch, dtype))
    t = inputs[comm.rank].clone()
    c.all_reduce(t, algorithm=algorithm)
    return {"traffic": c.stats.snapshot().get("all_reduce"),
            "unobserved": c.stats.bytes_unobserved,
            "correct": bool(torch.equal(t, torch.stack(inputs).sum(0)))}


def _run(pools, p: int, *args: Any) -> list[dict[str, Any]]:
    results = pools(p).run(all_reduce_traffic, *args)
    assert all(r["correct"] for r in results), "the all-reduce itself was wrong"
    return results


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_sends_2_p_minus_1_over_p_of_v_per_rank(pools, p):
    n = 1200  # divisible by 2, 3 and 4: the figure is exact
    v = n * 4
    for r, res in enumerate(_run(pools, p, "ring", n, BIG_CHUNK)):
        tr = res["traffic"]
        assert tr["calls"] == 1
        assert tr["bytes_sent"] == 2 * (p - 1) * v // p, f"rank {r}"
        assert tr["bytes_recv"] == 2 * (p - 1) * v // p, f"rank {r}"
        assert tr["msgs_sent"] == tr["msgs_recv"] == 2 * (p - 1), f"rank {r}"


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_uneven_size_is_within_rounding_and_exact_in_total(pools, p):
    n = 1001  # not divisible by 2, 3 or 4
    v = n * 8
    results = _run(pools, p, "ring", n, BIG_CHUNK, "int64")
    ideal = 2 * (p - 1) * v / p
    for r, res in enumerate(results):
        # each rank sends all segments but one, twice; segments are within one element of n/p
        assert abs(res["traffic"]["bytes_sent"] - ideal) < 2 * 8, f"rank {r}"
    sent = sum(res["traffic"]["bytes_sent"] for res in results)
    recv = sum(res["traffic"]["bytes_recv"] for res in results)
    assert sent == recv == 2 * (p - 1) * v


@pytest.mark.parametrize("p", [2, 3, 4])
def test_naive_sends_p_minus_1_times_v_per_rank(pools, p):
    n = 1001
    v = n * 4
    results = _run(pools, p, "naive", n, BIG_CHUNK)
    for r, res in enumerate(results):
        tr = res["traffic"]
        assert tr["bytes_sent"] == tr["bytes_recv"] == (p - 1) * v, f"rank {r}"
        assert tr["msgs_sent"] == tr["msgs_recv"] == p - 1, f"rank {r}"


@pytest.mark.parametrize("p", [2, 4])
def test_halving_doubling_sends_2_p_minus_1_over_p_of_v_on_powers_of_two(pools, p):
    n = 1024
    v = n * 4
    results = _run(pools, p, "halving_doubling", n, BIG_CHUNK)
    for r, res in enumerate(results):
        tr = res["traffic"]
        assert tr["bytes_sent"] == tr["bytes_recv"] == 2 * (p - 1) * v // p, f"rank {r}"
        assert tr["msgs_sent"] == 2 * int(math.log2(p)), f"rank {r}"


def test_received_bytes_equal_sent_bytes_over_ranks_for_halving_doubling_with_folding(pools):
    results = _run(pools, 3, "halving_doubling", 1001, BIG_CHUNK)  # p=3 folds one rank
    assert sum(r["traffic"]["bytes_sent"] for r in results) == sum(
        r["traffic"]["bytes_recv"] for r in results) > 0


@pytest.mark.parametrize("p", [2, 3, 4])
def test_small_chunks_send_the_same_bytes_in_more_messages(pools, p):
    n = 12000  # segments of 6000/4000/3000 float32 = 6/4/3 messages of ≤ 1024 elements
    big = _run(pools, p, "ring", n, BIG_CHUNK)
    small = _run(pools, p, "ring", n, 4096)
    per_segment = math.ceil(n // p / 1024)
    for r in range(p):
        assert small[r]["traffic"]["bytes_sent"] == big[r]["traffic"]["bytes_sent"]
        assert small[r]["traffic"]["msgs_sent"] == 2 * (p - 1) * per_segment, f"rank {r}"
        assert small[r]["traffic"]["msgs_recv"] == 2 * (p - 1) * per_segment, f"rank {r}"


@pytest.mark.parametrize("p", [2, 3])
def test_native_counts_the_call_but_no_bytes(pools, p):
    n = 1000
    for res in _run(pools, p, "native", n, BIG_CHUNK):
        tr = res["traffic"]
        assert tr["calls"] == 1
        assert tr["bytes_sent"] == tr["bytes_recv"] == tr["msgs_sent"] == 0
        assert res["unobserved"] == n * 4


def ring_small_chunks(comm: Communicator) -> list[str]:
    """Ring all_reduce / all_gather / reduce_scatter over many 4 KiB sub-chunks, uneven sizes."""
    c = _fresh(comm, chunk_bytes=4096)
    p, r, errors = comm.world_size, comm.rank, []
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for n in (1, 1023, 10007, 40961):
            inputs = _inputs(p, n, dtype)
            t = inputs[r].clone()
            c.all_reduce(t, algorithm="ring")
            if not torch.equal(t, torch.stack(inputs).sum(0)):
                errors.append(f"all_reduce {dtype} n={n}")
            out = torch.full((p * n,), 99, dtype=dtype)
            c.all_gather(out, inputs[r], algorithm="ring")
            if not torch.equal(out, torch.cat(inputs)):
                errors.append(f"all_gather {dtype} n={n}")
            blocks = _inputs(p, p * n, dtype)
            before = blocks[r].clone()
            got = torch.full((n,), 99, dtype=dtype)
            c.reduce_scatter(got, blocks[r], algorithm="ring")
            if not torch.equal(got, torch.stack(blocks).sum(0)[r * n : (r + 1) * n]):
                errors.append(f"reduce_scatter {dtype} n={n}")
            if not torch.equal(blocks[r], before):
                errors.append(f"reduce_scatter changed its input {dtype} n={n}")
    if c.stats.snapshot()["all_reduce"]["msgs_sent"] <= 2 * (p - 1) * 12:
        errors.append("4 KiB chunks did not split the messages")
    return errors


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_with_small_chunks_is_correct(pools, p):
    errors = [e for rank_errors in pools(p).run(ring_small_chunks) for e in rank_errors]
    assert not errors, errors


def flight_recorder_after_collectives(comm: Communicator) -> list[dict[str, Any]]:
    c = _fresh(comm, flight_recorder_size=3)
    t = torch.ones(10)
    c.all_reduce(t, algorithm="ring")
    c.broadcast(t, 0, algorithm="tree")
    c.all_gather(torch.empty(10 * comm.world_size), t, algorithm="naive")
    c.barrier(algorithm="naive")
    c.all_reduce(t, algorithm="naive", async_op=True).wait()  # type: ignore[union-attr]
    c.close()
    return c.flight_recorder.dump()


def test_flight_recorder_holds_the_latest_collectives_completed(pools):
    for records in pools(2).run(flight_recorder_after_collectives):
        assert [(r["seq"], r["op"], r["algorithm"]) for r in records] == [
            (3, "all_gather", "naive"), (4, "barrier", "naive"), (5, "all_reduce", "naive")]
        assert [r["nbytes"] for r in records] == [80, 0, 40]
        for r in records:
            assert r["state"] == "completed" and r["error"] == ""
            assert r["queued_at"] <= r["started_at"] <= r["ended_at"]


# ------------------------------------------------------------ scratch reused call to call
def scratch_reuse(comm: Communicator, algorithm: str, n: int) -> dict[str, Any]:
    """Three all-reduces of different inputs on one communicator: each result exact, and
    the landing buffers come from one arena that stops growing after the first call."""
    c = _fresh(comm)
    kept, pointers, correct = [], [], []
    for call in range(3):
        inputs = [x + call for x in _inputs(comm.world_size, n, torch.float32)]
        t = inputs[comm.rank].clone()
        c.all_reduce(t, algorithm=algorithm)
        correct.append(bool(torch.equal(t, torch.stack(inputs).sum(0))))
        kept.append(c._scratch.kept_bytes())
        pointers.append(c._scratch._buffers[torch.device("cpu")].data_ptr())
    c.close()
    return {"kept": kept, "pointers": pointers, "correct": correct,
            "cleared": c._scratch.kept_bytes()}


@pytest.mark.parametrize("algorithm", ["ring", "naive", "tree", "halving_doubling"])
def test_collectives_reuse_their_scratch_instead_of_allocating_per_call(pools, algorithm):
    n = (1 << 20) // 4 + 3  # 1 MiB and an uneven tail
    for res in pools(2).run(scratch_reuse, algorithm, n):
        assert res["correct"] == [True, True, True]
        assert res["kept"][0] > 0 and len(set(res["kept"])) == 1
        assert len(set(res["pointers"])) == 1  # the same memory every call
        assert res["cleared"] == 0  # close() gives it back


def test_scratch_regions_of_one_collective_are_disjoint_aligned_and_reused_by_the_next():
    from disttrain.comm.context import CollectiveContext, ScratchArena
    from disttrain.probe.wrappers import SoloTransport

    arena = ScratchArena(max_bytes=1 << 20)

    def ctx() -> CollectiveContext:
        return CollectiveContext(SoloTransport(), comm_stats(), op="all_reduce", seq=0,
                                 algorithm="ring", timeout_s=1.0, chunk_bytes=1 << 20,
                                 scratch=arena)

    first = ctx()
    a = first.scratch(3, torch.zeros(1, dtype=torch.uint8))  # 3 bytes: the next is realigned
    b = first.scratch(5, torch.zeros(1, dtype=torch.float64))
    c = first.scratch_copy(torch.arange(7, dtype=torch.int32))
    assert (a.dtype, b.dtype, c.dtype) == (torch.uint8, torch.float64, torch.int32)
    assert b.data_ptr() % 64 == 0 and c.data_ptr() % 64 == 0
    assert a.data_ptr() + 3 <= b.data_ptr() and b.data_ptr() + 40 <= c.data_ptr()
    assert c.tolist() == list(range(7))
    second = ctx()
    assert second.scratch(5, torch.zeros(1, dtype=torch.float64)).data_ptr() == a.data_ptr()
    # past the cap: a buffer of its own, not kept
    big = second.scratch((1 << 20) // 4, torch.zeros(1))
    assert big.numel() == (1 << 20) // 4 and arena.kept_bytes() == 1 << 20
    assert not a.data_ptr() <= big.data_ptr() < a.data_ptr() + (1 << 20)
    # without an arena every call allocates
    alone = CollectiveContext(SoloTransport(), comm_stats(), op="x", seq=0, algorithm="ring",
                              timeout_s=1.0, chunk_bytes=1)
    own = alone.scratch(4, torch.zeros(1))
    assert own.untyped_storage().nbytes() == 16  # a buffer of its own, not an arena view
    assert b.untyped_storage().nbytes() == 1 << 20  # the arena


def comm_stats():
    from disttrain.comm.stats import TrafficStats

    return TrafficStats()
