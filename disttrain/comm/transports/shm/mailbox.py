"""Point-to-point messages through per-pair mailboxes in shared memory (``isend``/``irecv``).

Each ordered pair src → dst owns a ring of ``K`` fixed-size slots and two counters: ``head``
(pieces published; only src writes it) and ``tail`` (pieces consumed; only dst writes it)::

    src ── write piece into slot head % K, then head += 1 ──▶  [ ][█][█][ ]  ── dst reads
                                                                 tail   head      slot tail % K,
    a message of any size = consecutive pieces                                     then tail += 1

Single writer per counter, so no atomics are needed (see docs/shm_transport.md for the
memory-ordering argument). A message streams piece by piece whenever the ring has room.

Matching follows MPI: a message matches the earliest posted receive with the same
(source, tag); messages of one (source, tag) arrive in the order they were sent. A message
that arrives before its receive is posted is drained into a private buffer ("unexpected"),
so a full ring never blocks a sender while the receiver waits for something else.

Progress: there is no background thread. Every ``wait``/``is_completed`` advances *all*
pending sends and receives of this rank under one lock (an async collective on the
communicator's progress thread and user point-to-point on the main thread may both be
waiting), so two ranks that each post a send and then wait on a receive never deadlock.

Sleeping: each rank has a doorbell word. Whoever publishes pieces to rank X, or frees
slots of a ring X sends through, stores a fresh value in X's doorbell and futex-wakes it.
A waiting rank reads its doorbell *before* making progress and sleeps only while the
doorbell still holds that value, so no event that could advance any of its operations
is missed.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
import torch

from disttrain.comm.transports.shm.segment import SLOT_HEADER, ShmLayout
from disttrain.comm.transports.shm.sync import PeerTable, ShmPeerTimeout, Waiter, futex_wake


class _Op:
    """A pending send or receive of ``data`` (a flat uint8 view of the user's tensor)."""

    __slots__ = ("data", "done", "error", "kind", "moved", "peer", "tag")

    def __init__(self, kind: str, data: torch.Tensor, peer: int, tag: int) -> None:
        self.kind, self.data, self.peer, self.tag = kind, data, peer, tag
        self.moved = 0  # bytes published (send) / matched to a message (recv: 0 or 1)
        self.done = False
        self.error: BaseException | None = None


class _Incoming:
    """A message being received from one source, into a receive's tensor or a private one."""

    __slots__ = ("buf", "received", "recv", "tag", "total")

    def __init__(self, tag: int, total: int, buf: torch.Tensor, recv: _Op | None) -> None:
        self.tag, self.total, self.buf, self.recv = tag, total, buf, recv
        self.received = 0


class ShmWork:
    """The handle ``isend``/``irecv`` return (the transport's RawWork)."""

    def __init__(self, boxes: Mailboxes, op: _Op) -> None:
        self._boxes, self._op = boxes, op

    def wait(self, timeout_s: float) -> None:
        self._boxes.wait(self._op, timeout_s)

    def is_completed(self) -> bool:
        return self._boxes.poll(self._op)


class Mailboxes:
    """This rank's side of all p·(p−1) mailboxes of a segment."""

    def __init__(self, u8: torch.Tensor, i64: np.ndarray, layout: ShmLayout, rank: int,
                 peers: PeerTable) -> None:
        self._u8, self._i64, self._layout, self._peers = u8, i64, layout, peers
        self.rank, p = rank, layout.world_size
        self._k = layout.mailbox_slots
        self._capacity = layout.mailbox_slot_bytes - SLOT_HEADER
        self._lock = threading.Lock()
        self._sends: list[deque[_Op]] = [deque() for _ in range(p)]
        self._posted: dict[tuple[int, int], deque[_Op]] = {}
        self._unexpected: dict[tuple[int, int], deque[_Incoming]] = {}
        self._current: list[_Incoming | None] = [None] * p
        out = [layout.pair(rank, d) if d != rank else -1 for d in range(p)]
        inc = [layout.pair(s, rank) if s != rank else -1 for s in range(p)]
        self._out_pair, self._in_pair = out, inc
        self._tail = [0] * p  # consumed pieces per source (this rank is the only writer)
        base = u8.data_ptr()
        self._bell_at = [layout.doorbell_line(r) // 8 for r in range(p)]
        self._bell_addr = [base + layout.doorbell_line(r) for r in range(p)]
        self._rings = 0

    # ------------------------------------------------------------------ posting
    def isend(self, data: torch.Tensor, dst: int, tag: int) -> ShmWork:
        op = _Op("send", data, dst, tag)
        with self._lock:
            self._sends[dst].append(op)
            self._push(dst)
        return ShmWork(self, op)

    def irecv(self, data: torch.Tensor, src: int, tag: int) -> ShmWork:
        op = _Op("recv", data, src, tag)
        with self._lock:
            early = self._unexpected.get((src, tag))
            if early:
                self._bind(early.popleft(), op)
            else:
                self._posted.setdefault((src, tag), deque()).append(op)
            self._progress()
        return ShmWork(self, op)

    # ------------------------------------------------------------------ waiting
    def poll(self, op: _Op) -> bool:
        with self._lock:
            self._progress()
            if op.error is not None:
                raise op.error
            return op.done

    def wait(self, op: _Op, timeout_s: float) -> None:
        bell_at, bell = self._bell_at[self.rank], [0]
        waiter = Waiter(timeout_s, self._peers, lambda: (op.peer,),
                        lambda: (self._bell_addr[self.rank], bell[0]))
        while True:
            bell[0] = int(self._i64[bell_at])  # read before progress: later events change it
            if self.poll(op):
                return
            try:
                waiter.pause()
            except ShmPeerTimeout:
                with self._lock:
                    self._cancel(op)
                raise

    def _ring(self, peer: int) -> None:
        """Tell ``peer`` something changed for it: a value no other ring produced lately."""
        self._rings += 1
        self._i64[self._bell_at[peer]] = ((self._rings & 0xFFFFFF) << 8) | (self.rank & 0xFF)
        futex_wake(self._bell_addr[peer])

    def _cancel(self, op: _Op) -> None:
        """Forget an op that timed out before any byte moved, so a later message with the
        same tag is not delivered to a receive nobody waits for."""
        if op.kind == "send" and op.moved == 0 and op in self._sends[op.peer]:
            self._sends[op.peer].remove(op)
        elif op.kind == "recv":
            posted = self._posted.get((op.peer, op.tag))
            if posted is not None and op in posted:
                posted.remove(op)

    # ------------------------------------------------------------------ progress
    def _progress(self) -> None:
        for peer in range(self._layout.world_size):
            if peer != self.rank:
                if self._sends[peer]:
                    self._push(peer)
                self._pull(peer)

    def _push(self, dst: int) -> None:
        """Publish pieces of the queued sends to ``dst`` while its ring has room."""
        queue, pair, lay = self._sends[dst], self._out_pair[dst], self._layout
        head_at, tail_at = lay.head_line(pair) // 8, lay.tail_line(pair) // 8
        head = start = int(self._i64[head_at])
        free = self._k - (head - int(self._i64[tail_at]))
        while queue and free > 0:
            op = queue[0]
            total = op.data.numel()
            n = min(self._capacity, total - op.moved)
            base = lay.mailbox_slot(pair, head % self._k)
            self._u8[base + SLOT_HEADER : base + SLOT_HEADER + n].copy_(
                op.data[op.moved : op.moved + n])
            self._i64[base // 8 : base // 8 + 4] = (op.tag, total, op.moved, n)
            head += 1
            self._i64[head_at] = head  # publish after the payload and header (x86 TSO)
            op.moved += n
            free -= 1
            if op.moved == total:
                op.done = True
                queue.popleft()
        if head != start:
            self._ring(dst)

    def _pull(self, src: int) -> None:
        """Consume every piece ``src`` has published to this rank."""
        pair, lay = self._in_pair[src], self._layout
        head_at, tail_at = lay.head_line(pair) // 8, lay.tail_line(pair) // 8
        tail = self._tail[src]
        head = int(self._i64[head_at])
        while tail < head:
            base = lay.mailbox_slot(pair, tail % self._k)
            tag, total, offset, n = (int(x) for x in self._i64[base // 8 : base // 8 + 4])
            msg = self._current[src]
            if msg is None:
                msg = self._start(src, tag, total)
            if offset != msg.received or tag != msg.tag:
                raise RuntimeError(f"shared-memory mailbox from rank {src} is corrupt: piece "
                                   f"(tag {tag}, offset {offset}) after {msg.received} bytes")
            msg.buf[offset : offset + n].copy_(
                self._u8[base + SLOT_HEADER : base + SLOT_HEADER + n])
            tail += 1
            self._i64[tail_at] = tail  # release the slot only after reading it
            msg.received += n
            if msg.received == msg.total:
                self._current[src] = None
                self._finish(msg)
            if tail == head:
                head = int(self._i64[head_at])
        if tail != self._tail[src]:  # freed slots: a sender with a full ring may wait
            self._tail[src] = tail
            self._ring(src)

    def _start(self, src: int, tag: int, total: int) -> _Incoming:
        posted = self._posted.get((src, tag))
        if posted:
            recv = posted.popleft()
            if recv.data.numel() == total:
                msg = _Incoming(tag, total, recv.data, recv)
            else:  # drain into scratch, then report the mismatch on the receive
                msg = _Incoming(tag, total, torch.empty(total, dtype=torch.uint8), None)
                self._bind(msg, recv)
        else:
            msg = _Incoming(tag, total, torch.empty(total, dtype=torch.uint8), None)
            self._unexpected.setdefault((src, tag), deque()).append(msg)
        self._current[src] = msg
        return msg

    def _bind(self, msg: _Incoming, recv: _Op) -> None:
        """Give a message that arrived into a private buffer to the receive ``recv``."""
        recv.moved = 1
        if msg.total != recv.data.numel():
            recv.error = ValueError(
                f"rank {recv.peer} sent {msg.total} bytes with tag {recv.tag} but the receive "
                f"buffer holds {recv.data.numel()} bytes; both sides must use the same size")
            recv.done = True
            return
        msg.recv = recv
        if msg.received == msg.total:
            self._finish(msg)

    @staticmethod
    def _finish(msg: _Incoming) -> None:
        recv = msg.recv
        if recv is None or recv.done:
            return  # unexpected: waits in its queue for a receive
        if msg.buf is not recv.data:
            recv.data.copy_(msg.buf)
        recv.done = True
