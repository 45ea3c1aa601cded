"""The ring's buffer reuse under an adversarial transport, in one process (threads as ranks).

The ring posts every receive up front, lands all-gather data straight in the output buffer
and starts the all-gather of each owned sub-chunk while the next one is still reduced. Each
is safe only because of the ring's data dependencies, not because of any timing. This
transport picks its timing at random, within what a real one may do:

* a send's bytes are read from the sender's buffer at any moment between ``isend`` and the
  first of (the sender's ``wait``, the receiver needing them), so a buffer the algorithm
  reuses before its send completed is caught;
* a receive lands at any moment between both sides being posted and the receiver's
  ``wait``, so data landing in a region still in use is caught.

Every result is compared exactly (int64) with the sum, for several world sizes, lengths not
divisible by p and sub-chunk sizes down to a few elements.
"""

from __future__ import annotations

import random
import threading
from collections import deque

import pytest
import torch

from disttrain.comm.algorithms import ring
from disttrain.comm.context import CollectiveContext
from disttrain.comm.ops import ReduceOp
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport

TIMEOUT_S = 10.0


class _Message:
    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.snapshot: torch.Tensor | None = None

    def read(self) -> torch.Tensor:
        if self.snapshot is None:
            self.snapshot = self.data.clone()
        return self.snapshot


class _Landing:
    def __init__(self, into: torch.Tensor) -> None:
        self.into = into
        self.message: _Message | None = None
        self.filled = False

    def fill(self) -> None:
        if not self.filled and self.message is not None:
            self.into.copy_(self.message.read())
            self.filled = True


class _Network:
    def __init__(self, seed: int) -> None:
        self.cond = threading.Condition()
        self.rng = random.Random(seed)
        self.sends: dict[tuple[int, int, int], deque[_Message]] = {}
        self.recvs: dict[tuple[int, int, int], deque[_Landing]] = {}

    def post(self, key: tuple[int, int, int], item: _Message | _Landing) -> None:
        with self.cond:
            if isinstance(item, _Message):
                self.sends.setdefault(key, deque()).append(item)
            else:
                self.recvs.setdefault(key, deque()).append(item)
            sends, recvs = self.sends.get(key), self.recvs.get(key)
            while sends and recvs:  # match in posting order (MPI / Gloo semantics per tag)
                landing = recvs.popleft()
                landing.message = sends.popleft()
                if self.rng.random() < 0.5:
                    landing.fill()  # eager: lands now, from the other rank's thread
            self.cond.notify_all()


class _SendWork:
    def __init__(self, net: _Network, message: _Message) -> None:
        self.net, self.message = net, message

    def wait(self, timeout_s: float) -> None:
        with self.net.cond:
            self.message.read()  # at the latest now the bytes are gone from the buffer

    def is_completed(self) -> bool:
        return self.message.snapshot is not None


class _RecvWork:
    def __init__(self, net: _Network, landing: _Landing) -> None:
        self.net, self.landing = net, landing

    def wait(self, timeout_s: float) -> None:
        with self.net.cond:
            if not self.net.cond.wait_for(lambda: self.landing.message is not None,
                                          timeout_s):
                raise TimeoutError("no matching send")
            self.landing.fill()

    def is_completed(self) -> bool:
        return self.landing.filled


class _ThreadTransport(Transport):
    name = "threads-test"

    def __init__(self, net: _Network, rank: int, world_size: int) -> None:
        self.net, self._rank, self._world_size = net, rank, world_size

    rank = property(lambda self: self._rank)  # type: ignore[assignment]
    world_size = property(lambda self: self._world_size)  # type: ignore[assignment]
    global_ranks = property(lambda self: tuple(range(self._world_size)))  # type: ignore[assignment]

    def isend(self, tensor, dst, tag):  # type: ignore[no-untyped-def]
        message = _Message(tensor)
        self.net.post((self._rank, dst, tag), message)
        return _SendWork(self.net, message)

    def irecv(self, tensor, src, tag):  # type: ignore[no-untyped-def]
        landing = _Landing(tensor)
        self.net.post((src, self._rank, tag), landing)
        return _RecvWork(self.net, landing)

    def subgroup(self, ranks):  # type: ignore[no-untyped-def]
        return None


def _run(p: int, n: int, chunk_elems: int, seed: int) -> None:
    net = _Network(seed)
    inputs = [torch.randint(-1000, 1000, (n,), generator=torch.Generator().manual_seed(seed + r),
                            dtype=torch.int64) for r in range(p)]
    expected = torch.stack(inputs).sum(0)
    outputs = [x.clone() for x in inputs]
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        ctx = CollectiveContext(_ThreadTransport(net, r, p), TrafficStats(), op="all_reduce",
                                seq=1, algorithm="ring", timeout_s=TIMEOUT_S,
                                chunk_bytes=8 * chunk_elems)
        try:
            ring.all_reduce(ctx, outputs[r], ReduceOp.SUM)
        except BaseException as exc:  # reported below, with the rank
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    assert not errors and not any(t.is_alive() for t in threads), errors
    for r in range(p):
        assert torch.equal(outputs[r], expected), (p, n, chunk_elems, seed, r)


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_ring_all_reduce_survives_adversarial_timing(p: int) -> None:
    for seed in range(12):
        for n, chunk in [(1, 1), (7, 1), (101, 3), (1000, 64), (4099, 1 << 20)]:
            _run(p, n, chunk, 1000 * p + seed)
