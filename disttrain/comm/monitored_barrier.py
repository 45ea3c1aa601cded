"""A barrier that names the ranks that did not arrive in time (like torch's monitored_barrier).

Built only on the Communicator's point-to-point calls, so it works on every transport::

    rank 1 ──token──►┐                       ┌──► rank 1   every rank learns the same
    rank 2 ──token──►├ rank 0 waits until ───┼──► rank 2   arrival table and raises the
    rank 3 ──(late)  ┘ the deadline, then    └──► rank 3   same error naming rank 3
                       sends the arrival table

Rank 0 waits for each token on its own thread rather than with a timed wait: Gloo treats an
expired wait as fatal and closes every connection of the rank, which would keep rank 0 from
telling the others who was missing. A rank that arrives late still gets the table (it was
sent to every rank) and raises the same error. If rank 0 itself never arrives, the others
give up after twice the timeout and name rank 0.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any

import torch

from disttrain.comm.communicator import Communicator
from disttrain.comm.context import MAX_USER_TAG
from disttrain.comm.errors import CommError, CommTimeoutError, PeerFailedError

_TAGS = 4096  # the top of the user tag space is reserved for monitored barriers
_TAG_BASE = MAX_USER_TAG - _TAGS + 1
_calls: weakref.WeakKeyDictionary[Communicator, int] = weakref.WeakKeyDictionary()
_abandoned: collections.deque[Any] = collections.deque(maxlen=256)  # pending sends' buffers


class BarrierTimeoutError(CommTimeoutError):
    """Some ranks did not reach a monitored barrier in time; ``missing`` lists them."""

    def __init__(self, message: str, *, seq: int, missing: tuple[int, ...]) -> None:
        super().__init__(message, op="monitored_barrier", seq=seq,
                         peer=missing[0] if missing else None)
        self.missing = missing


def monitored_barrier(comm: Communicator, timeout_s: float | None = None) -> None:
    """Return when every rank of ``comm`` has arrived; otherwise raise, on every rank that
    gets that far, a :class:`BarrierTimeoutError` naming the ranks that did not arrive
    within ``timeout_s`` (default: the communicator's timeout) of rank 0."""
    timeout = float(comm.config.timeout_s if timeout_s is None else timeout_s)
    if not timeout > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    seq = _calls.get(comm, 0) + 1
    _calls[comm] = seq
    if comm.world_size == 1:
        return
    tag = _TAG_BASE + seq % _TAGS
    table = _root(comm, tag, timeout) if comm.rank == 0 else _member(comm, tag, timeout, seq)
    late = [r for r in range(comm.world_size) if table[r] == _LATE]
    dead = [r for r in range(comm.world_size) if table[r] == _BROKEN]
    if late or dead:
        parts = []
        if late:
            parts.append(f"{_ranks(late)} did not arrive within {timeout:g}s (dead, stuck, "
                         "or waiting in another collective)")
        if dead:
            parts.append(f"the connection to {_ranks(dead)} broke (it most likely died)")
        raise BarrierTimeoutError(f"monitored_barrier #{seq} on rank {comm.rank}: "
                                  f"{'; '.join(parts)}", seq=seq, missing=tuple(late + dead))


_ARRIVED, _LATE, _BROKEN = 1, 0, -1


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _member(comm: Communicator, tag: int, timeout: float, seq: int) -> list[int]:
    """A rank other than 0: check in, then wait for rank 0's arrival table."""
    table = torch.zeros(comm.world_size, dtype=torch.int64)
    limit = 2 * timeout + 1  # rank 0 waits up to ``timeout`` after it arrives, then answers
    try:
        comm.isend(torch.ones(1, dtype=torch.int64), 0, tag).wait(limit)
        comm.irecv(table, 0, tag).wait(limit)
    except CommError as exc:
        raise BarrierTimeoutError(
            f"monitored_barrier #{seq} on rank {comm.rank}: rank 0 did not release the "
            f"barrier within {limit:g}s; rank 0 did not arrive (stuck, dead, or in another "
            f"collective) ({exc})", seq=seq, missing=(0,)) from exc
    return [int(v) for v in table.tolist()]


def _root(comm: Communicator, tag: int, timeout: float) -> list[int]:
    """Rank 0: collect tokens until the deadline, then send everyone the arrival table."""
    state = _collect(comm, tag, timeout)
    table = torch.tensor(state, dtype=torch.int64)
    for peer in range(1, comm.world_size):
        if state[peer] == _BROKEN:
            continue  # nothing can reach it
        try:  # informing is best effort: a peer that cannot be told times out by itself
            work = comm.isend(table, peer, tag)
            if state[peer] == _ARRIVED:
                work.wait(timeout)
            else:
                _abandoned.append((work, table))  # delivered if it ever arrives
        except (CommError, RuntimeError, ConnectionError):
            pass  # the table already went out to others: keep every rank's verdict the same
    return state


def _collect(comm: Communicator, tag: int, timeout: float) -> list[int]:
    """Per rank: arrived, late, or broken link. Each token is waited for on its own thread,
    with more patience than anyone else has, so no wait of rank 0 expires first."""
    state = [_ARRIVED] + [_LATE] * (comm.world_size - 1)
    lock = threading.Lock()
    done = threading.Semaphore(0)
    patience = 2 * timeout + 10

    def wait_for(peer: int, work: Any) -> None:
        try:
            work.wait(patience)
            outcome = _ARRIVED
        except CommError:
            outcome = _BROKEN
        with lock:
            if state[peer] == _LATE and not closed:
                state[peer] = outcome
        done.release()

    closed = False
    tokens = {peer: torch.zeros(1, dtype=torch.int64) for peer in range(1, comm.world_size)}
    works = {}
    for peer, token in tokens.items():  # posted here: the communicator's bookkeeping is
        try:  # not thread-safe
            works[peer] = comm.irecv(token, peer, tag)
        except PeerFailedError:  # refused at once: the connection to it is closed already
            state[peer] = _BROKEN  # (a communicator that failed earlier still raises)
    for peer, work in works.items():
        threading.Thread(target=wait_for, args=(peer, work), daemon=True,
                         name=f"monitored-barrier-r{peer}").start()
    deadline = time.monotonic() + timeout
    for _ in works:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    with lock:
        closed = True  # later arrivals are late, whatever their threads find
        return list(state)
