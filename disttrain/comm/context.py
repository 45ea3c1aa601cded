"""What an algorithm sees of a collective in flight: its rank, peers, and named, counted P2P.

Every message an algorithm sends goes through :class:`CollectiveContext`, which

* skips zero-byte messages on both sides (both sides know every size, so they agree),
* tags messages by algorithm step, so messages of different steps never mix,
* counts bytes and messages per collective in the transport's :class:`TrafficStats`,
* turns a transport's ``TimeoutError``/``ConnectionError``, whether raised by a wait or
  when a message is posted, into an error that names the operation, its sequence number,
  the peer being waited for and, when the transport can tell
  (:meth:`CollectiveContext.unresponsive`), the ranks that are really to blame.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.comm.errors import CommError, CommTimeoutError, PeerFailedError
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import DoneWork, PairTimeoutError, RawWork, Transport

# Tags at or above this value belong to collectives; user point-to-point tags stay below it.
COLLECTIVE_TAG_BASE = 1 << 24
MAX_USER_TAG = COLLECTIVE_TAG_BASE - 1
INSTANCE_TAGS = 1 << 13  # collective tags per communicator instance on one group
_STEP_TAGS = 1 << 12
_instances: dict[int, int] = {}
_instances_lock = threading.Lock()


def instance_tag_base(transport: Transport) -> int:
    """The first collective tag of a new communicator over ``transport``: communicators on
    one group (or one transport) get disjoint tag ranges, so their messages never mix."""
    native = transport.native_group
    group_key = id(native) if native is not None else id(transport)
    with _instances_lock:
        index = _instances.get(group_key, 0)
        _instances[group_key] = index + 1
    return COLLECTIVE_TAG_BASE + (index % 64) * INSTANCE_TAGS
# Longest wait for the other survivors of a failure to check in when no silent rank is a
# known fact (dead or stopped; those are named at once). It bounds how late a failure is
# reported after the timeout: a hang detector must answer within timeout + a few seconds.
_MAX_GRACE_S = 4.5
_SCRATCH_ALIGN = 64  # bytes: every scratch region starts on a cache line


def check_in_s(timeout_s: float) -> float:
    """How long a rank whose wait failed waits for the other survivors to check in."""
    return min(timeout_s, _MAX_GRACE_S) + 0.5


def longest_wait_s(timeout_s: float) -> float:
    """The longest a communicator with ``timeout_s`` blocks before it raises an error that
    names the rank to blame: the timeout, then the survivors' check-in."""
    return timeout_s + check_in_s(timeout_s)


class ScratchArena:
    """Scratch memory that the collectives of one communicator reuse.

    Algorithms need landing buffers (a ring's receive scratch is (p−1)/p of the tensor,
    naive's p − 1 whole copies). Allocated per call, a buffer of several MiB is fresh memory
    every time, and the kernel faults in each of its pages on first touch: on this project's
    VM, filling a new 32 MiB buffer took 27-29 ms against 4.5 ms for a reused one, which made
    the ring's 64 MiB all-reduce on 2 ranks 1.46× Gloo's. A communicator runs its
    collectives one at a time (in call order, on one thread), so one arena per
    communicator is enough: each :class:`CollectiveContext` hands out consecutive regions
    of it and the next collective starts again at 0. Requests beyond ``max_bytes`` in
    total are allocated per call and not kept. A collective that fails leaves its
    communicator unusable, so a late message can never land in a region that a later
    collective uses. The exception is ValueError/TypeError (bad arguments), which leave it
    usable: an algorithm must raise those before posting its first receive.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def buffer(self, device: torch.device, end: int) -> torch.Tensor | None:
        """The arena of ``device`` holding at least ``end`` bytes, or None past the cap.
        Growing replaces the buffer; regions already handed out keep the old one alive."""
        if end > self.max_bytes:
            return None
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < end:
            if buf is not None and buf.is_cuda:  # freed once its regions go: not before
                buf.record_stream(torch.cuda.current_stream())  # this stream's kernels end
            size = min(self.max_bytes, -(-end // (1 << 20)) * (1 << 20))  # whole MiB
            buf = self._buffers[device] = torch.empty(size, dtype=torch.uint8, device=device)
        return buf

    def kept_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        self._buffers.clear()


@dataclass
class Pending:
    """A message in flight, remembering its peer and direction for error messages."""

    raw: RawWork
    peer: int
    kind: str  # "send" or "recv"


class CollectiveContext:
    """One collective call: the algorithm's only door to the network."""

    def __init__(
        self,
        transport: Transport,
        stats: TrafficStats,
        *,
        op: str,
        seq: int,
        algorithm: str,
        timeout_s: float,
        chunk_bytes: int,
        tag_base: int = COLLECTIVE_TAG_BASE,
        on_progress: Callable[[], None] | None = None,
        scratch: ScratchArena | None = None,
        probe_posts: bool = True,
        probe_waits: bool = True,
        hierarchy: Callable[[CollectiveContext], Any] | None = None,
    ) -> None:
        self.transport = transport
        self.stats = stats
        self.op = op
        self.seq = seq
        self.algorithm = algorithm
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self._tag_base = tag_base
        self._on_progress = on_progress  # told of every completed message (async backstop)
        self.rank = transport.rank
        self.world_size = transport.world_size
        self._arena = scratch  # None: every scratch buffer is allocated per call
        self._scratch_end = 0
        # False (single point-to-point messages): a refused post raises at once, naming the
        # peer, instead of first waiting up to the grace period for the others to check in
        self._probe_posts = probe_posts
        self.notes: dict[int, str] = {}  # how each blamed rank is known (unresponsive())
        self._probe_waits = probe_waits  # False: a broken wait names its peer at once too
        self._hierarchy = hierarchy  # the calling communicator's (hierarchical algorithm)

    def hierarchy(self) -> Any:
        """The calling communicator's :class:`~disttrain.comm.topology.Hierarchy`, built
        (collectively) on its first use; the communicator owns and closes it."""
        if self._hierarchy is None:
            raise CommError(f"{self.op}: algorithm='hierarchical' runs only as a collective "
                            f"of a Communicator (it owns the sub-communicators)")
        return self._hierarchy(self)

    def scratch(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        """``numel`` uninitialised elements of ``like``'s dtype and device, for this
        collective only: the region is handed out again once this collective returns (see
        :class:`ScratchArena`). Never return it to the caller or keep it."""
        nbytes = numel * like.element_size()
        if self._arena is not None and nbytes > 0:
            start = -(-self._scratch_end // _SCRATCH_ALIGN) * _SCRATCH_ALIGN
            buf = self._arena.buffer(like.device, start + nbytes)
            if buf is not None:
                self._scratch_end = start + nbytes
                return buf[start : start + nbytes].view(like.dtype)
        return like.new_empty(numel)

    def scratch_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """Scratch of ``tensor``'s shape, dtype and device (uninitialised)."""
        return self.scratch(tensor.numel(), tensor).view(tensor.shape)

    def scratch_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in scratch (what ``tensor.clone()`` gives, without fresh
        memory)."""
        return self.scratch_like(tensor).copy_(tensor)

    @property
    def native_group(self) -> Any:
        return self.transport.native_group

    def _tag(self, step: int) -> int:
        return self._tag_base + (step % _STEP_TAGS)

    def isend(self, tensor: torch.Tensor, peer: int, step: int = 0) -> Pending:
        if tensor.numel() == 0:
            return Pending(DoneWork(), peer, "send")
        raw = self._post(self.transport.isend, tensor, peer, step, "send")
        self.stats.count_send(self.op, tensor.numel() * tensor.element_size())
        return Pending(raw, peer, "send")

    def irecv(self, tensor: torch.Tensor, peer: int, step: int = 0, *,
              counted: int | None = None) -> Pending:
        """``counted``: the bytes to count as received, where ``tensor`` is posted larger
        than the message it expects (:mod:`disttrain.comm.overrun`); its size otherwise."""
        if tensor.numel() == 0:
            return Pending(DoneWork(), peer, "recv")
        raw = self._post(self.transport.irecv, tensor, peer, step, "recv")
        self.stats.count_recv(self.op, tensor.numel() * tensor.element_size()
                              if counted is None else counted)
        return Pending(raw, peer, "recv")

    def _post(self, post: Callable[[torch.Tensor, int, int], RawWork], tensor: torch.Tensor,
              peer: int, step: int, kind: str) -> RawWork:
        """Start one message. Posting can fail too: Gloo refuses a send or receive on a
        connection that already broke (a peer that died or gave up a moment ago), so the
        error must name the operation and the peer as a failed wait does. A refusal is
        immediate whatever Gloo's reason (a closed connection, or a pair closed by an
        earlier timeout), so it never reads as "timed out after …"; a post that blocked
        until its timeout creating the pair's connection (:class:`PairTimeoutError`) does."""
        try:
            return post(tensor, peer, self._tag(step))
        except (TimeoutError, ConnectionError) as exc:
            raise self.failure(describe_wait("starting", kind, peer), exc, peer,
                               timed_out=isinstance(exc, PairTimeoutError),
                               probe=self._probe_posts) from exc

    def connect(self, peers: Iterable[int]) -> None:
        """Create this rank's connections to ``peers`` where the transport makes them at
        the first message (:meth:`Transport.connect`): an algorithm whose first contacts
        form a cycle (a ring's receive from the left) would otherwise hang on NCCL."""
        wanted = sorted(set(peers) - {self.rank})
        if not wanted:
            return
        try:
            self.transport.connect(wanted)
        except (TimeoutError, ConnectionError) as exc:
            peer = getattr(exc, "peer", None)
            raise self.failure(f"creating the connection to rank {peer}" if peer is not None
                               else f"creating the connections to ranks {wanted}", exc, peer,
                               timed_out=isinstance(exc, TimeoutError)) from exc

    def wait(self, pending: Pending) -> None:
        """Wait for one message; on failure, name the op, its sequence number and the peer."""
        try:
            pending.raw.wait(self.timeout_s)
        except (TimeoutError, ConnectionError) as exc:
            raise self.failure(describe_wait("waiting", pending.kind, pending.peer), exc,
                               pending.peer, timed_out=isinstance(exc, TimeoutError),
                               probe=self._probe_waits) from exc
        if self._on_progress is not None:
            self._on_progress()

    def progressed(self) -> None:
        """Tell the async backstop that this collective is moving (for algorithms that make
        progress without messages, e.g. shared-memory barriers)."""
        if self._on_progress is not None:
            self._on_progress()

    def unresponsive(self) -> list[int] | None:
        """Ranks that did not check in after this failure, or None when unknown.

        The peer a rank waits for is often not the culprit: it may itself be waiting for a
        stuck or dead rank. Survivors notice a failure within about one timeout of each
        other, so each checks in with the transport and waits that long for the others;
        whoever never checks in is dead or stuck outside this collective. A rank known to
        be dead or stopped is named at once (:mod:`disttrain.comm.checkin`); how it is
        known is kept for the message (:attr:`notes`)."""
        if self.world_size == 1:
            return None
        diagnose = getattr(self.transport, "diagnose", None)
        if diagnose is not None:
            verdict = diagnose(self.check_in_s)
            if verdict is None:
                return None
            self.notes = dict(verdict.notes)
            return list(verdict.missing)
        probe = getattr(self.transport, "unresponsive_ranks", None)
        if probe is None:
            return None
        result: list[int] | None = probe(self.check_in_s)
        return result

    @property
    def check_in_s(self) -> float:
        """How long :meth:`unresponsive` waits for the other survivors to check in."""
        return check_in_s(self.timeout_s)

    @property
    def longest_wait_s(self) -> float:
        """The longest :meth:`wait` blocks: its timeout, then the survivors' check-in."""
        return longest_wait_s(self.timeout_s)

    def failure(self, doing: str, exc: BaseException, waited: int | None, *,
                timed_out: bool, probe: bool = True) -> CommTimeoutError | PeerFailedError:
        """The error for a wait that timed out or whose connection broke.

        Gloo treats an expired wait as fatal and closes all of that rank's connections, so
        a broken connection often means a live peer gave up, not that it died: if the peer
        waited for checks in afterwards, the failure is reported as the timeout it is.
        Where a dead peer closes nothing (NCCL: ``in_order`` transports), a wait for a peer
        the check-in knows dead is reported as that peer's failure.
        ``probe=False`` skips that check-in (and its wait)."""
        missing = self.unresponsive() if probe else None
        where = f"{self.op} #{self.seq} ({self.algorithm}) on rank {self.rank}"
        suspects = tuple(missing or ())
        known = [f"rank {r} {self.notes[r]}" for r in suspects if r in self.notes]
        if missing and known:
            blame = f"rank(s) {missing} did not check in afterwards: {'; '.join(known)}"
        elif missing:
            blame = (f"rank(s) {missing} did not check in afterwards: they are stuck outside "
                     f"this collective, called a different one, or died")
        elif missing is None:
            blame = ("which rank is to blame is not known" if probe else
                     f"rank {waited} died, or gave up after a timeout of its own")
        else:
            blame = "every rank checked in afterwards: none died"
        if timed_out and self.transport.in_order and waited in suspects and (
                self.notes.get(waited, "").startswith("died")):
            # NCCL reports a dead peer as a wait that never ends, not a closed connection:
            # known dead, it failed as a broken connection would have said on Gloo
            return PeerFailedError(f"{where}: rank {waited} died while this rank was {doing}; "
                                   f"{blame} ({exc})", op=self.op, seq=self.seq, peer=waited,
                                   suspects=suspects)
        if timed_out or (missing is not None and waited is not None and waited not in missing):
            what = (f"timed out after {self.timeout_s:g}s {doing}" if timed_out else
                    f"rank {waited} gave up (it timed out and closed its connections) while "
                    f"this rank was {doing}")
            return CommTimeoutError(f"{where}: {what}; {blame} ({exc})", op=self.op,
                                    seq=self.seq, peer=waited, suspects=suspects)
        hint = "" if self.algorithm == "p2p" or known else (
            f". If a dead rank's log shows Gloo's 'Received data size doesn't match expected "
            f"size', ranks called {self.op} with different sizes or dtypes, and "
            f"CommConfig(debug_checks=True) names them")
        text = f"{where}: a connection broke while {doing}; {blame}{hint} ({exc})"
        # the rank this one was talking to when it is among the missing, else the first
        peer = missing[0] if missing and waited not in missing else waited
        return PeerFailedError(text, op=self.op, seq=self.seq, peer=peer, suspects=suspects)

    def wait_all(self, pendings: Iterable[Pending]) -> None:
        for pending in pendings:
            self.wait(pending)

    def send(self, tensor: torch.Tensor, peer: int, step: int = 0) -> None:
        self.wait(self.isend(tensor, peer, step))

    def recv(self, tensor: torch.Tensor, peer: int, step: int = 0) -> None:
        self.wait(self.irecv(tensor, peer, step))

    def sendrecv(
        self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, step: int = 0
    ) -> None:
        """Exchange with two peers at once (both directions of a link busy)."""
        if dst == src:
            self.wait_all(self.exchange(send, recv, dst, step))
        else:
            self.wait_all([self.irecv(recv, src, step), self.isend(send, dst, step)])

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int,
                 step: int = 0) -> list[Pending]:
        """Post a send to and a receive from the same ``peer``, the lower rank sending
        first. Where a pair's messages run one after the other in posting order (NCCL), a
        receive posted first on both sides would wait forever for a send queued behind the
        other side's receive; this order pairs each send with the other side's receive."""
        if self.rank < peer:
            return [self.isend(send, peer, step), self.irecv(recv, peer, step)]
        return [self.irecv(recv, peer, step), self.isend(send, peer, step)]


def describe_wait(what: str, kind: str, peer: int) -> str:
    """``waiting to send to rank 2``, ``starting to recv from rank 0``."""
    return f"{what} to {kind} {'to' if kind == 'send' else 'from'} rank {peer}"
