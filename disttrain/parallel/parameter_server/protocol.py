"""The wire protocol: a fixed-size int64 header, then raw tensor payloads (nothing is pickled);
the errors that name a peer; the event loop every conversation runs on.

Gloo point-to-point needs the receiver to know every message's size in advance, so each
message starts with a header of :data:`HEADER_FIELDS` int64 (96 bytes), always the same size:

    field          request (worker → server)                 reply (server → worker)
    -------------  ----------------------------------------  ---------------------------------
    MAGIC          0x44545053 ("DTPS")                       same
    VERSION        protocol version (3)                      same
    TYPE           HELLO PULL PUSH SPARSE_PULL SPARSE_PUSH    GRANT or REPLY
                   CLOCK HEARTBEAT DONE
    STATUS         0                                         0 = OK, else the error (Status)
    SENDER         the sender's rank (checked against the    the server's rank
                   rank the message came from)
    KEY            dense: global offset of the first element same as the request
                   sparse: index of the embedding table
                   HELLO: the config fingerprint
    COUNT          dense: elements; sparse: rows; DONE: W    elements/rows of the reply payload
    DTYPE          payload dtype code (DTYPE_CODES)          same
    CLOCK          the worker's clock                        HELLO: the server's clock
    PARAM_VERSION  CLOCK (or END_CLOCK push): the version    the server's parameter version
                   the worker pulled
    SEQ            request number (per worker and server)    echoed: replies match requests
    EXTRA          flags: END_CLOCK on a worker's last push  0
                   of a clock (saves a separate CLOCK)

A request that carries a payload (PUSH, SPARSE_PULL, SPARSE_PUSH) is sent in two halves: the
header, then, only after the server answers GRANT, the payload (SPARSE_* send the int64 row
ids first, then the row values). The server validates every header field before it grants,
and a rejected request leaves no stray payload behind in the transport (HTTP's ``Expect:
100-continue`` works the same way).

Every payload message, both ways, ends with a 32-byte **trailer** (four little-endian int64:
``TRAILER_MAGIC`` "DTPT", the request's SEQ, the payload's index in the request, its byte
count), and lands in a zero-filled buffer: Gloo completes a receive that got *fewer* bytes
without saying so, so a short payload would otherwise be used with whatever the buffer held
before. A receiver reads the trailer where the granted size puts it: a short payload leaves
zeros there, a long one payload bytes, a stale one (sent for another request) another SEQ;
each is refused (Status BAD_PAYLOAD) and never applied (:mod:`.channel`). A server also
sizes each payload receive for the largest payload it accepts at all (``max_message_elems``
elements of 8 bytes, reserved as untouched zero pages), because Gloo aborts the process that
receives *more* bytes than it posted (in its I/O thread, beyond any handler): a message
larger than that reserve still ends the server, as it would end any Gloo receiver. A worker
that sends a bad payload counts as failed (:class:`PSPayloadError`): dropped where the mode
outlives a lost worker, else the server stops, naming it.
Every request gets exactly one REPLY; a REPLY with STATUS ≠ OK is a rejection, logged on the
server, which goes on serving. The exception is PEER_FAILED: a server that stops because a
peer failed answers the requests it holds (at a consistency gate, or a DONE) with it (KEY:
that rank). DONE (COUNT: the number of workers W) is answered once every worker is done or
lost and the servers agreed on who was lost: its reply carries W int64 flags, 1 for each
lost worker (:meth:`~.server.ParameterServer.serve`).
On Gloo, tags name the four streams (:data:`TAG_REQUEST` …); NCCL ignores tags and matches a
pair's messages in posting order, so both sides post every message of a request in the
order of the flow (:mod:`.channel`), which keeps the streams apart there too.

Errors (:class:`PSError` and its kinds) name the peer by role and rank and what to do.
The event loop (:func:`drive`, :class:`Watcher`) runs a server's W conversations, or a
worker's S, from one thread; the two ends of a conversation are in :mod:`.channel`.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from disttrain.comm import CommError, CommTimeoutError, Work


class PSError(CommError):
    """Something went wrong in a parameter-server job."""


class PSPeerError(PSError):
    """A peer failed; ``rank`` is its rank when known (the message names its role too)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class PSTimeoutError(PSPeerError):
    """A peer did not answer (or, for a server, a worker sent nothing) within the timeout."""


class PSPeerFailedError(PSPeerError):
    """A peer's connection broke (the process most likely died), or a server reported that
    another rank failed."""


class PSPayloadError(PSPeerFailedError):
    """A peer sent a payload that is not the one agreed (shorter, longer, or from another
    request): nothing it sends can be trusted any more, so it counts as failed."""


class PSRejectedError(PSError):
    """A server rejected a request (the reply carried an error status)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ProtocolError(PSError):
    """A message broke the protocol. ``status`` is the code sent back to the sender."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ----------------------------------------------------------------------
# The wire format: a fixed-size int64 header, then raw tensor payloads.

MAGIC = 0x44545053  # "DTPS"
PROTOCOL_VERSION = 3
HEADER_FIELDS = 12

# Point-to-point tags (the Communicator's user range is 0 … 2**24 − 1).
TAG_REQUEST = 0x505300  # worker → server headers
TAG_REQUEST_PAYLOAD = 0x505301  # worker → server payloads (after a GRANT)
TAG_REPLY = 0x505302  # server → worker headers (GRANT, REPLY)
TAG_REPLY_PAYLOAD = 0x505303  # server → worker payloads (pulled values)
TAG_SERVERS = 0x505304  # server ↔ server: the workers each lost (at the end of a run)


class Msg(IntEnum):
    HELLO = 1
    PULL = 2
    PUSH = 3
    SPARSE_PULL = 4
    SPARSE_PUSH = 5
    CLOCK = 6
    HEARTBEAT = 7
    DONE = 8
    GRANT = 9
    REPLY = 10


REQUESTS = frozenset({Msg.HELLO, Msg.PULL, Msg.PUSH, Msg.SPARSE_PULL, Msg.SPARSE_PUSH,
                      Msg.CLOCK, Msg.HEARTBEAT, Msg.DONE})
WITH_PAYLOAD = frozenset({Msg.PUSH, Msg.SPARSE_PULL, Msg.SPARSE_PUSH})
WITH_DTYPE = frozenset({Msg.PULL, Msg.PUSH, Msg.SPARSE_PULL, Msg.SPARSE_PUSH})


class Status(IntEnum):
    OK = 0
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    BAD_SENDER = 4
    BAD_DTYPE = 5
    TOO_LARGE = 6
    UNKNOWN_KEY = 7
    BAD_SIZE = 8
    BAD_ROWS = 9
    BAD_CLOCK = 10
    CONFIG_MISMATCH = 11
    PEER_FAILED = 12  # reply only: the server stops because rank KEY failed
    BAD_PAYLOAD = 13  # a payload shorter, longer or older than its request (see trailer)


_MSG_VALUES = frozenset(int(m) for m in Msg)
_STATUS_VALUES = frozenset(int(s) for s in Status)

END_CLOCK = 1  # EXTRA flag: this push also finishes the clock (as a CLOCK request would)

DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float64: 2, torch.float16: 3,
                                        torch.bfloat16: 4, torch.int64: 5}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPE_CODES:
        raise ValueError(f"dtype {dtype} cannot travel in a parameter-server message; use one "
                         f"of {', '.join(str(d) for d in DTYPE_CODES)}")
    return DTYPE_CODES[dtype]


def dtype_of(code: int) -> torch.dtype:
    if code not in _DTYPES:
        raise ProtocolError(Status.BAD_DTYPE, f"unknown dtype code {code}")
    return _DTYPES[code]


@dataclass(frozen=True)
class Header:
    """One header, field by field (see the module docstring for their meaning)."""

    type: int
    sender: int
    key: int = 0
    count: int = 0
    dtype: int = 0
    clock: int = 0
    version: int = 0
    seq: int = 0
    status: int = 0
    extra: int = 0
    magic: int = MAGIC
    protocol: int = PROTOCOL_VERSION

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.magic, self.protocol, self.type, self.status, self.sender,
                             self.key, self.count, self.dtype, self.clock, self.version,
                             self.seq, self.extra], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, raw: torch.Tensor) -> Header:
        v = [int(x) for x in raw.tolist()]
        return cls(magic=v[0], protocol=v[1], type=v[2], status=v[3], sender=v[4], key=v[5],
                   count=v[6], dtype=v[7], clock=v[8], version=v[9], seq=v[10], extra=v[11])

    def describe(self) -> str:
        kind = Msg(self.type).name if self.type in _MSG_VALUES else f"type {self.type}"
        return f"{kind} key={self.key} count={self.count} clock={self.clock} seq={self.seq}"


def empty_header() -> torch.Tensor:
    """A receive buffer for one header."""
    return torch.zeros(HEADER_FIELDS, dtype=torch.int64)


def decode_request(raw: torch.Tensor, src: int, max_elems: int) -> Header:
    """Parse and check what can be checked without the server's key table; raise
    :class:`ProtocolError` with the status to send back."""
    h = Header.from_tensor(raw)
    if h.magic != MAGIC:
        raise ProtocolError(Status.BAD_MAGIC, f"bad magic {h.magic:#x} (expected {MAGIC:#x}): "
                            f"not a disttrain parameter-server message")
    if h.protocol != PROTOCOL_VERSION:
        raise ProtocolError(Status.BAD_VERSION, f"protocol version {h.protocol}, this server "
                            f"speaks {PROTOCOL_VERSION}")
    if h.type not in REQUESTS:
        raise ProtocolError(Status.BAD_TYPE, f"message type {h.type} is not a request")
    if h.sender != src:
        raise ProtocolError(Status.BAD_SENDER, f"sender field says rank {h.sender} but the "
                            f"message came from rank {src}")
    if h.type in WITH_DTYPE:
        dtype_of(h.dtype)
    if h.extra not in (0, END_CLOCK) or (h.extra and h.type not in (Msg.PUSH, Msg.SPARSE_PUSH)):
        raise ProtocolError(Status.BAD_TYPE, f"flags {h.extra} are not valid on {h.describe()}")
    if h.count < 0 or h.key < 0 or h.clock < 0 or h.version < 0:
        raise ProtocolError(Status.BAD_SIZE, f"negative key, count, clock or version in "
                            f"{h.describe()}")
    if h.count > max_elems:
        raise ProtocolError(Status.TOO_LARGE, f"{h.describe()} is larger than the "
                            f"{max_elems}-element limit (max_message_elems)")
    return h


def decode_reply(raw: torch.Tensor, src: int, request: Header, expected: Msg) -> Header:
    """Parse and check a server's answer to ``request``; a bad reply is a ProtocolError."""
    h = Header.from_tensor(raw)
    problem = None
    if h.magic != MAGIC or h.protocol != PROTOCOL_VERSION:
        problem = f"bad magic {h.magic:#x} or protocol version {h.protocol}"
    elif h.sender != src:
        problem = f"sender field {h.sender} but it came from rank {src}"
    elif h.seq != request.seq:
        problem = f"it answers request #{h.seq}, not #{request.seq}"
    elif h.status == Status.OK and h.type != expected:
        problem = f"message type {h.type} where {expected.name} was expected"
    if problem is not None:
        raise ProtocolError(Status.BAD_TYPE, f"malformed reply to {request.describe()}: {problem}")
    return h


def status_name(status: int) -> str:
    return Status(status).name if status in _STATUS_VALUES else f"status {status}"


# ----------------------------------------------------------------------
# A tiny cooperative event loop: conversations are generators that yield what they await.
#
# A server talks to W workers at once and a worker to S servers at once, from one thread.
# Each conversation (one worker's requests at a server; a worker's requests to one server)
# is a generator that yields :class:`Wait` objects, typically "this message has arrived";
# :func:`drive` resumes every conversation whose wait is over and sleeps until something
# changes.
#
# Why helper threads: Gloo's point-to-point work never reports ``is_completed()`` until
# someone calls ``wait()`` on it, and a ``wait(timeout)`` that times out breaks the whole
# Gloo context. So a :class:`Watcher` thread blocks in ``wait()`` for each receive in flight
# and sets a flag (and wakes the loop) when it returns, with the error if the peer died.
# Sends are not watched: a send has completed once the peer answers the message, so it is
# collected then (:func:`settle`), without a thread hand-off.
# The loop keeps its own deadline per wait (``timeout_s``, shorter than the communicator's),
# so a silent peer is reported by role and rank before Gloo's own timeout fires.

_IDLE_CHECK_S = 0.1  # a safety net: completions wake the loop at once


class Watch:
    """One message in flight; ``done`` turns True when its ``wait()`` returned or failed."""

    def __init__(self, work: Work, wakeup: threading.Event) -> None:
        self.work, self._wakeup = work, wakeup
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self.done = True
            self._wakeup.set()


class Watcher:
    """Daemon threads that block in ``Work.wait()``; one per message in flight at most.

    Threads are reused; a new one starts only when all are busy. They are daemons, so a
    wait that never returns (a peer that died mid-message) cannot keep the process alive."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.wakeup = threading.Event()
        self._queue: queue.SimpleQueue[Watch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def watch(self, work: Work) -> Watch:
        item = Watch(work, self.wakeup)
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._serve, name=f"{self.name}-wait{self._threads}",
                                 daemon=True).start()
        self._queue.put(item)
        return item

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            item.run()
            with self._lock:
                self._idle += 1

    def close(self) -> None:
        """Stop the idle threads (busy ones end with their wait)."""
        with self._lock:
            count = self._threads
        for _ in range(count):
            self._queue.put(None)


@dataclass
class Wait:
    """What a conversation waits for; past ``deadline`` (time.monotonic) ``expired()``
    builds the error to raise."""

    ready: Callable[[], bool]
    deadline: float = math.inf
    expired: Callable[[], BaseException] | None = None


Task = Generator[Wait, None, Any]


def on_watch(watch: Watch, timeout_s: float, peer: str, rank: int, doing: str,
             died: Callable[[int], str | None] | None = None) -> Wait:
    """Wait for a watched message to or from ``peer`` (rank ``rank``) at most ``timeout_s``.
    Past it, ``died(rank)`` (``Communicator.peer_died``) tells a dead peer from a silent
    one: on NCCL a dead peer closes no connection, so its death shows only as silence."""
    def expired() -> BaseException:
        note = died(rank) if died is not None else None
        if note is not None:
            return PSPeerFailedError(f"{peer} failed: it {note} while {doing} (no message "
                                     f"came within {timeout_s:g}s)", rank)
        return PSTimeoutError(f"{peer} did not answer within {timeout_s:g}s while {doing}: "
                              f"it died, hangs, or is slower than timeout_s", rank)

    return Wait(lambda: watch.done, time.monotonic() + timeout_s, expired)


def post(start: Callable[[], Work], peer: str, rank: int, doing: str) -> Work:
    """Start a send or receive; Gloo refuses at once when the peer's connection is closed."""
    try:
        return start()
    except RuntimeError as exc:  # Gloo's error, or the communicator's after an earlier one
        raise PSPeerFailedError(f"{peer} failed: its connection is closed ({doing}); the "
                                f"process most likely died ({exc})", rank) from exc


def settle(sends: list[Work], peer: str, rank: int, doing: str) -> None:
    """Collect sends that must have completed because the peer answered after receiving
    them: their ``wait()`` returns at once, so no watcher thread is spent on them."""
    try:
        for work in sends:
            work.wait()
    except Exception as exc:
        raise PSPeerFailedError(f"{peer} failed: its connection broke ({doing}); the process "
                                f"most likely died ({exc})", rank) from exc
    sends.clear()


def finish(watch: Watch, peer: str, rank: int, doing: str) -> None:
    """Raise the transport's error, if the message failed, as one naming the peer: a broken
    connection as PSPeerFailedError (the peer died), a transport timeout as PSTimeoutError
    (a silent peer is no dead one: nobody may go on without it)."""
    if isinstance(watch.error, CommTimeoutError):
        raise PSTimeoutError(f"{peer} did not answer while {doing}: the transport's own "
                             f"timeout expired ({watch.error})", rank) from watch.error
    if watch.error is not None:
        raise PSPeerFailedError(f"{peer} failed: its connection broke while {doing}; the "
                                f"process most likely died ({watch.error})",
                                rank) from watch.error


def drive(tasks: Sequence[Task], wakeup: threading.Event) -> list[Any]:
    """Run the conversations until all return; returns their return values in order.
    A deadline's error is raised inside its conversation, which may handle it (a server
    that outlives a worker found dead when its deadline passed); the first error a
    conversation does not handle is raised and the others are closed. ``wakeup`` is set by
    the watcher when a message completes."""
    results: list[Any] = [None] * len(tasks)
    current: dict[int, Wait] = {}

    def advance(i: int, error: BaseException | None = None) -> None:
        try:
            current[i] = next(tasks[i]) if error is None else tasks[i].throw(error)
        except StopIteration as stop:
            results[i] = stop.value
            current.pop(i, None)

    try:
        for i in range(len(tasks)):
            advance(i)
        while current:
            wakeup.clear()  # before the scan: a completion during it is not lost
            progressed = False
            now = time.monotonic()
            for i, wait in list(current.items()):
                if wait.ready():
                    advance(i)
                    progressed = True
                elif now > wait.deadline:
                    advance(i, wait.expired() if wait.expired is not None else TimeoutError())
                    progressed = True
            if not progressed:
                nearest = min(w.deadline for w in current.values()) - now
                wakeup.wait(max(0.0, min(_IDLE_CHECK_S, nearest)))
    finally:
        for task in tasks:
            task.close()
    return results
