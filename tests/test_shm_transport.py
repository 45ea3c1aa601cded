"""The shared-memory transport: layout arithmetic, liveness, point-to-point with tags,
streaming through full mailboxes, timeouts, sub-groups and transport selection."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports import SharedMemoryTransport, ShmConfig, make_transport
from disttrain.comm.transports.shm import collectives as shm_algorithms
from disttrain.comm.transports.shm import sync as shm_sync
from disttrain.comm.transports.shm.segment import LINE, is_alive, process_start_time

# Small mailboxes: a 40 KiB message needs several pieces and fills the ring.
TINY = ShmConfig(slot_bytes=8192, mailbox_slots=2, mailbox_slot_bytes=4096,
                 one_shot_max_bytes=4096)
_transport: SharedMemoryTransport | None = None


def tiny_transport() -> SharedMemoryTransport:
    global _transport
    if _transport is None:
        _transport = SharedMemoryTransport(config=TINY)
    return _transport


# ----------------------------------------------------------------------------- pure layout
@pytest.mark.parametrize("p", [1, 2, 3, 5])
def test_layout_regions_are_disjoint_and_aligned(p):
    lay = ShmConfig(slot_bytes=8192, mailbox_slots=3, mailbox_slot_bytes=4096).layout(p)
    spans = [(0, LINE)]
    for r in range(p):
        spans += [(lay.rank_line(r), lay.rank_line(r) + LINE),
                  (lay.arrive_line(r), lay.arrive_line(r) + LINE),
                  (lay.doorbell_line(r), lay.doorbell_line(r) + LINE)]
    pairs = [lay.pair(s, d) for s in range(p) for d in range(p) if s != d]
    assert sorted(pairs) == list(range(p * (p - 1)))
    for k in pairs:
        spans += [(lay.head_line(k), lay.head_line(k) + LINE),
                  (lay.tail_line(k), lay.tail_line(k) + LINE)]
        spans += [(lay.mailbox_slot(k, i), lay.mailbox_slot(k, i) + 4096) for i in range(3)]
    spans += [(lay.slot(s, r), lay.slot(s, r) + 8192) for s in (0, 1) for r in range(p)]
    spans.sort()
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, "two regions of the segment overlap"
    assert spans[-1][1] <= lay.size and lay.size % 4096 == 0
    assert all(start % LINE == 0 for start, _ in spans)
    assert lay.region(1) == lay.slot(1, 0) == lay.slot(0, p - 1) + 8192


def test_segment_size_does_not_depend_on_messages():
    """Only p and the configured sizes enter the size; by default the collective area is
    16 MiB (4 MiB slots for 2 ranks, 2 MiB for 4, 1 MiB from 8 on)."""
    for p, slot in [(2, 4 << 20), (4, 2 << 20), (8, 1 << 20), (16, 1 << 20)]:
        lay = ShmConfig().layout(p)
        assert lay.slot_bytes == slot
        control = -(-64 * (1 + 3 * p + 2 * p * (p - 1)) // 4096) * 4096
        assert lay.size == control + 2 * p * slot + p * (p - 1) * 4 * (128 << 10)
    assert ShmConfig(slot_bytes=8192).layout(4).slot_bytes == 8192


@pytest.mark.parametrize("kwargs, fix", [
    ({"slot_bytes": 1000}, "multiple of 64"),
    ({"mailbox_slots": 1}, "mailbox_slots must be ≥ 2"),
    ({"one_shot_max_bytes": -1}, "one_shot_max_bytes must be an int ≥ 0"),
])
def test_config_errors_say_what_to_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        ShmConfig(**kwargs)


def test_liveness_sees_exit_and_zombies():
    """A child that exited but was not reaped (a zombie) counts as dead, as does a pid
    whose start time differs (a recycled pid)."""
    me = os.getpid()
    assert is_alive(me, process_start_time(me))
    assert not is_alive(me, process_start_time(me) + 1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = process_start_time(child.pid)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, still a zombie
    assert not is_alive(child.pid, start)
    child.wait()
    assert not is_alive(child.pid, start)


@pytest.mark.skipif(not shm_sync.FUTEX_AVAILABLE, reason="futexes are Linux-only")
def test_futex_wakes_a_sleeper_and_never_sleeps_on_a_stale_value():
    word = np.zeros(8, dtype=np.int64)  # one cache line; the futex is its first 4 bytes
    address = word.ctypes.data
    woke = threading.Event()

    def sleeper() -> None:
        while word[0] == 0:
            shm_sync.futex_wait(address, 0, 30.0)  # far longer than the join below
        woke.set()

    thread = threading.Thread(target=sleeper, daemon=True)
    thread.start()
    thread.join(0.2)  # let it fall asleep
    word[0] = 1
    shm_sync.futex_wake(address)
    thread.join(10.0)
    assert woke.is_set(), "FUTEX_WAKE after the store did not wake the sleeper"
    shm_sync.futex_wait(address, 0, 30.0)  # the word holds 1, not 0: returns at once


# ----------------------------------------------------------------------------- on ranks
def tagged_messages(_comm: Communicator) -> list[list[float]]:
    """Rank 0 sends tag 5 then tag 7 (large: > the mailbox ring) then tag 5 again; rank 1
    receives 7 first, then the two tag-5 messages in order."""
    t = tiny_transport()
    big = 10_000  # 40 KiB of float32: 10 pieces through a 2-slot ring
    if t.rank == 0:
        works = [t.isend(torch.full((3,), 1.0), 1, 5),
                 t.isend(torch.arange(big, dtype=torch.float32), 1, 7),
                 t.isend(torch.full((3,), 2.0), 1, 5)]
        for w in works:
            w.wait(20)
        return []
    seven, first, second = torch.empty(big), torch.empty(3), torch.empty(3)
    t.irecv(seven, 0, 7).wait(20)
    t.irecv(first, 0, 5).wait(20)
    t.irecv(second, 0, 5).wait(20)
    assert torch.equal(seven, torch.arange(big, dtype=torch.float32))
    return [first.tolist(), second.tolist()]


def test_tags_are_matched_in_order(pools):
    results = pools(2).run(tagged_messages)
    assert results[1] == [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]


def exchange_both_ways(_comm: Communicator, n: int) -> bool:
    """Every rank posts a large send to every other rank, then waits on its receives:
    progress on any wait advances all transfers, so nobody deadlocks on full rings."""
    t = tiny_transport()
    p, r = t.world_size, t.rank
    sends = [t.isend(torch.full((n,), float(r * 10 + d)), d, 3) for d in range(p) if d != r]
    outs = {s: torch.empty(n) for s in range(p) if s != r}
    for s, out in outs.items():
        t.irecv(out, s, 3).wait(20)
        assert bool((out == s * 10 + r).all())
    for w in sends:
        w.wait(20)
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_large_sends_both_ways_do_not_deadlock(pools, world_size):
    assert all(pools(world_size).run(exchange_both_ways, 50_000))


def receive_times_out(_comm: Communicator) -> str:
    """A receive nobody answers raises TimeoutError; it is then cancelled, so the next
    message with the same tag reaches the next receive."""
    t = tiny_transport()
    if t.rank == 1:
        try:
            t.irecv(torch.empty(2), 0, 11).wait(0.3)
        except TimeoutError as exc:
            message = f"{type(exc).__name__}: {exc}"
        else:
            message = "no timeout"
    else:
        message = ""
    t.collectives.step(20)  # both ranks: only now rank 0 sends
    if t.rank == 0:
        t.isend(torch.tensor([4.0, 2.0]), 1, 11).wait(20)
    else:
        got = torch.empty(2)
        t.irecv(got, 0, 11).wait(20)
        assert got.tolist() == [4.0, 2.0]
    return message


def test_receive_timeout_names_the_rank_and_cancels(pools):
    message = pools(2).run(receive_times_out)[1]
    assert message.startswith("ShmPeerTimeout") and "rank(s) [0]" in message


def subgroup_sums(_comm: Communicator) -> list[float] | None:
    """A sub-communicator over ranks [3, 1] (in that order) with its own segment."""
    comm = Communicator(tiny_transport(), CommConfig(timeout_s=20))
    sub = comm.new_group([3, 1])
    if sub is None:
        return None
    x = torch.full((5000,), float(comm.rank))
    y = x.clone()
    sub.all_reduce(x, algorithm="shm")
    sub.all_reduce(y, algorithm="ring")
    name = sub.transport.segment_name  # type: ignore[attr-defined]
    assert not os.path.exists(f"/dev/shm/{name}")
    return [float(x[0]), float(y[-1]), float(sub.rank)]


def test_subgroup_has_its_own_segment(pools):
    results = pools(4).run(subgroup_sums)
    assert results[0] is None and results[2] is None
    assert results[3] == [4.0, 4.0, 0.0] and results[1] == [4.0, 4.0, 1.0]


def selection(_comm: Communicator) -> list[str]:
    names = []
    for name in ("auto", "shm", "torch"):
        transport = make_transport(name)
        names.append(transport.name)
        transport.close()
        if isinstance(transport, SharedMemoryTransport):
            with pytest.raises(RuntimeError, match="transport is closed"):
                transport.isend(torch.ones(1), 1 - transport.rank, 0)
    torch_comm = Communicator(make_transport("torch"))
    with pytest.raises(ValueError, match=r"algorithm='shm' cannot run on the 'torch' transport"):
        torch_comm.all_reduce(torch.ones(2), algorithm="shm")
    assert not shm_algorithms.supports(torch_comm.transport)
    with pytest.raises(ValueError, match="transport='tcp' is unknown"):
        make_transport("tcp")
    return names


def test_make_transport_picks_shm_on_one_host(pools):
    assert pools(2).run(selection) == [["shm", "shm", "torch"]] * 2
