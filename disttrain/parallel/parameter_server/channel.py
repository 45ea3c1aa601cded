"""The two ends of a conversation: a worker's :class:`Channel` to one server (send a request,
get its reply) and a server's :class:`ServerIO` to every worker.

Request flow (the header fields are in :mod:`.protocol`)::

    worker                                   server
      │── header (TAG_REQUEST) ───────────────►│ validate every field
      │◄─────────────────── GRANT (TAG_REPLY) ──│ only for requests with a payload
      │── payload(s) (TAG_REQUEST_PAYLOAD) ────►│ sizes agreed in the header
      │◄─────────────────── REPLY (TAG_REPLY) ──│ status; PULL may wait here (sync, ssp)
      │◄──────────── values (TAG_REPLY_PAYLOAD) ─│ only for an OK PULL / SPARSE_PULL

Every payload is sealed with a trailer and checked on arrival (:func:`seal`, :func:`unseal`;
the format is in :mod:`.protocol`). The reply-payload receive is posted only after an OK
reply header has arrived, so a rejected request never leaves a receive behind. Both sides
post each message of a request in the order of the flow above (a receive only after the
sends before it): NCCL ignores the tags, matches a pair's messages in posting order and runs
them one after the other, so a reply receive posted ahead of the request would wait for ever
on the worker's own queue (:mod:`disttrain.comm.nccl_rules`). The tags still name the four
streams on Gloo.

On the server every receive is watched (:class:`~.protocol.Watcher`) and awaited with the
server's deadline, so a worker that stops talking is named by role and rank, never waited on
forever. Sends to a worker are collected when its next message arrives, which proves they
completed (:func:`~.protocol.settle`), or awaited explicitly by :meth:`ServerIO.flush` when
none follows.
"""

from __future__ import annotations

import functools
import struct
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.comm import Communicator, Work
from disttrain.comm.overrun import aborts_on_overrun, anonymous_buffer
from disttrain.parallel.parameter_server.partition import PSRoles
from disttrain.parallel.parameter_server.protocol import (
    TAG_REPLY,
    TAG_REPLY_PAYLOAD,
    TAG_REQUEST,
    TAG_REQUEST_PAYLOAD,
    TAG_SERVERS,
    Header,
    Msg,
    ProtocolError,
    PSError,
    PSPayloadError,
    PSPeerFailedError,
    PSRejectedError,
    Status,
    Wait,
    Watch,
    Watcher,
    decode_reply,
    empty_header,
    finish,
    on_watch,
    post,
    settle,
    status_name,
)

Reply = Callable[[Header, "torch.Tensor | None"], None]

# ----------------------------------------------------------------------
# Sealed payloads: the bytes, then a trailer the receiver checks where the grant puts it.

TRAILER_MAGIC = 0x44545054  # "DTPT"
_TRAILER = struct.Struct("<4q")  # magic, request SEQ, payload index, payload bytes
TRAILER_BYTES = _TRAILER.size


def seal(payload: torch.Tensor, seq: int, index: int) -> torch.Tensor:
    """``payload``'s bytes followed by its trailer, as one uint8 message on its device."""
    data = payload.detach().contiguous().view(-1).view(torch.uint8)
    trailer = torch.frombuffer(bytearray(_TRAILER.pack(TRAILER_MAGIC, seq, index,
                                                       data.numel())), dtype=torch.uint8)
    return torch.cat([data, trailer.to(data.device)])


def receive_buffer(nbytes: int, reserve: int = 0) -> torch.Tensor:
    """A zero-filled uint8 buffer for a sealed ``nbytes``-byte payload. With ``reserve``
    larger than the sealed size it spans ``reserve`` bytes of anonymous memory: zero pages
    the kernel commits only where a message writes, so a longer message lands in it (and is
    refused by its trailer) instead of overrunning Gloo's receive, which aborts."""
    size = nbytes + TRAILER_BYTES
    region = anonymous_buffer(reserve) if reserve > size else None
    # no address space for the reserve: the exact size still works
    return region if region is not None else torch.zeros(size, dtype=torch.uint8)


def unseal(buffer: torch.Tensor, nbytes: int, seq: int, index: int,
           dtype: torch.dtype) -> torch.Tensor:
    """The ``nbytes``-byte payload in ``buffer`` as ``dtype``, once its trailer says it is
    payload ``index`` of request ``seq`` and ends where the grant says; ProtocolError
    (BAD_PAYLOAD) saying what arrived instead."""
    found = _TRAILER.unpack(buffer[nbytes:nbytes + TRAILER_BYTES].cpu().numpy().tobytes())
    if found != (TRAILER_MAGIC, seq, index, nbytes):
        raise ProtocolError(Status.BAD_PAYLOAD, f"payload {index} of request #{seq} is "
                            f"{_what_arrived(buffer, nbytes, found, seq)}; it was not used")
    return buffer[:nbytes].view(dtype)


def _what_arrived(buffer: torch.Tensor, nbytes: int, found: tuple[int, ...],
                  seq: int) -> str:
    magic, their_seq, their_index, their_bytes = found
    if magic == TRAILER_MAGIC and their_seq != seq:
        return f"stale: it was sealed for request #{their_seq}"
    if magic == TRAILER_MAGIC:
        return f"sealed as payload {their_index} of {their_bytes} bytes, where {nbytes} bytes " \
               f"were granted"
    if not bool(buffer[nbytes:].any()):  # read only on this path: it may span the reserve
        return f"shorter than the {nbytes} bytes (+ {TRAILER_BYTES}-byte trailer) granted"
    return f"longer than the {nbytes} bytes (+ {TRAILER_BYTES}-byte trailer) granted, or " \
           f"not sealed"




@dataclass
class Request:
    """One request: its header fields, payloads to send after the GRANT, the size of the
    values expected back, and what to do with the reply."""

    type: Msg
    key: int = 0
    count: int = 0
    dtype: int = 0
    clock: int = 0
    version: int = 0
    extra: int = 0
    payloads: list[torch.Tensor] = field(default_factory=list)
    reply_elems: int = 0
    reply_dtype: torch.dtype = torch.float32
    on_reply: Reply | None = None


class Channel:
    """Requests from this worker to server ``rank``, numbered so replies can be matched."""

    def __init__(self, comm: Communicator, watcher: Watcher, rank: int,
                 describe: Callable[[int], str], timeout_s: float) -> None:
        self.comm, self.watcher, self.rank, self.describe = comm, watcher, rank, describe
        self.peer = describe(rank)
        self.timeout_s = timeout_s
        self.seq = 0
        self.version = 0  # the server's parameter version in its latest reply

    def run(self, requests: list[Request], timeout_s: float | None = None
            ) -> Generator[Wait, None, None]:
        """Send ``requests`` one after another (each waits for the previous reply), each wait
        limited to ``timeout_s`` (default: the channel's)."""
        for request in requests:
            reply, values = yield from self.exchange(request, timeout_s or self.timeout_s)
            if request.on_reply is not None:
                request.on_reply(reply, values)

    def exchange(self, req: Request, timeout_s: float
                 ) -> Generator[Wait, None, tuple[Header, Any]]:
        self.seq += 1
        h = Header(req.type, self.comm.rank, key=req.key, count=req.count, dtype=req.dtype,
                   clock=req.clock, version=req.version, seq=self.seq, extra=req.extra)
        doing = f"this worker waited for the answer to {h.describe()}"
        wait = functools.partial(self._await, timeout_s=timeout_s)
        reply = empty_header()
        sends = [self._post(self.comm.isend, h.to_tensor(), TAG_REQUEST, doing)]
        reply_work = self._post(self.comm.irecv, reply, TAG_REPLY, doing)
        if req.payloads:
            yield from wait(reply_work, doing)
            settle(sends, self.peer, self.rank, doing)
            self._check(decode_reply(reply, self.rank, h, Msg.GRANT), h)
            sends += [self._post(self.comm.isend, seal(p, h.seq, i), TAG_REQUEST_PAYLOAD, doing)
                      for i, p in enumerate(req.payloads)]
            reply = empty_header()
            reply_work = self._post(self.comm.irecv, reply, TAG_REPLY, doing)
        yield from wait(reply_work, doing)
        settle(sends, self.peer, self.rank, doing)  # the server answered: it has them all
        answer = decode_reply(reply, self.rank, h, Msg.REPLY)
        self._check(answer, h)
        self.version = answer.version
        values = None
        if req.reply_elems:
            if answer.count != req.count:
                raise ProtocolError(Status.BAD_SIZE, f"{self.peer} answered {h.describe()} "
                                    f"with {answer.count} items instead of {req.count}")
            nbytes = req.reply_elems * req.reply_dtype.itemsize
            buffer = receive_buffer(nbytes)  # a server is trusted not to send more
            yield from wait(self._post(self.comm.irecv, buffer, TAG_REPLY_PAYLOAD, doing), doing)
            try:
                values = unseal(buffer, nbytes, h.seq, 0, req.reply_dtype)
            except ProtocolError as exc:
                raise ProtocolError(exc.status, f"{self.peer} answered {h.describe()}: "
                                    f"{exc}") from None
        return answer, values

    def _post(self, start: Callable[..., Work], tensor: torch.Tensor, tag: int,
              doing: str) -> Work:
        # a broken connection names the server at once (no check-in round)
        return post(lambda: start(tensor, self.rank, tag, check_in=False), self.peer,
                    self.rank, doing)

    def _await(self, work: Any, doing: str, timeout_s: float) -> Generator[Wait, None, None]:
        watch = self.watcher.watch(work)
        yield on_watch(watch, timeout_s, self.peer, self.rank, doing, self.comm.peer_died)
        finish(watch, self.peer, self.rank, doing)

    def _check(self, answer: Header, request: Header) -> None:
        if answer.status == Status.PEER_FAILED:
            culprit = self.describe(answer.key) if 0 <= answer.key < self.comm.world_size \
                else "another rank"
            raise PSPeerFailedError(f"{self.peer} stopped serving because {culprit} failed "
                                    f"(see that server's log)", answer.key)
        if answer.status != Status.OK:
            raise PSRejectedError(f"{self.peer} rejected {request.describe()}: "
                                  f"{status_name(answer.status)} (details in the server's log)",
                                  answer.status)


# ----------------------------------------------------------------------
# The server's side of the message flow (the worker's side is :class:`Channel`, above).

Gen = Generator[Wait, None, Any]


class ServerIO:
    """Receive requests and payloads from workers, send GRANTs and REPLYs to them."""

    def __init__(self, comm: Communicator, roles: PSRoles, timeout_s: float,
                 version: Callable[[], int], max_payload_bytes: int = 0) -> None:
        self.comm, self.roles, self.timeout_s = comm, roles, timeout_s
        # Gloo aborts a receiver sent more than it posted: size payload receives for the
        # largest payload accepted (other transports enforce sizes: exact buffers there)
        gloo = aborts_on_overrun(comm)
        self.reserve = max_payload_bytes + TRAILER_BYTES if gloo and max_payload_bytes else 0
        self.name = roles.describe(comm.rank)
        self._version = version  # the parameter version every answer reports
        self.watcher = Watcher(f"ps-{roles.role(comm.rank).kind}{roles.role(comm.rank).index}")
        self._unsettled: dict[int, list[Work]] = {}  # sends per worker rank not yet collected
        self._asking: dict[int, tuple[torch.Tensor, Watch]] = {}  # awaited request per worker

    def request(self, rank: int, timeout_s: float | None = None
                ) -> Generator[Wait, None, torch.Tensor]:
        """The next request header from worker ``rank`` (raw: the caller validates it)."""
        raw = empty_header()
        doing = f"{self.name} waited for its next request or heartbeat"
        peer = self.roles.describe(rank)
        watch = self.watcher.watch(self._post(self.comm.irecv, raw, rank, TAG_REQUEST, doing))
        self._asking[rank] = (raw, watch)
        yield on_watch(watch, timeout_s or self.timeout_s, peer, rank, doing,
                       self.comm.peer_died)
        del self._asking[rank]
        finish(watch, peer, rank, doing)
        self._settle(rank, "sending earlier replies")  # it asks again: it got them all
        return raw

    def asking(self) -> list[int]:
        """The workers whose next request is awaited (after a stop: was awaited)."""
        return list(self._asking)

    def refuse_next(self, rank: int, key: int, grace_s: float) -> Gen:
        """Best effort, once the server stopped: answer worker ``rank``'s next request, if it
        comes within ``grace_s``, with PEER_FAILED (KEY: the failed rank), so the worker
        learns why instead of finding this server gone."""
        raw, watch = self._asking.pop(rank)
        deadline = time.monotonic() + grace_s
        yield Wait(lambda: watch.done or time.monotonic() > deadline)
        if not watch.done or watch.error is not None:
            return
        try:
            self.reply(rank, Header.from_tensor(raw), status=Status.PEER_FAILED, key=key)
            yield from self.flush(rank)
        except PSError:  # it is gone too: nobody left to tell
            pass

    def payloads(self, rank: int, h: Header,
                 sizes: list[tuple[int, torch.dtype]]) -> Generator[Wait, None, list[Any]]:
        """GRANT request ``h``, then receive its payloads (sizes already validated) and check
        their trailers. The receives come after the GRANT, in the order the worker sends
        (see :mod:`.channel`). A bad payload is answered BAD_PAYLOAD and raised as
        :class:`~.protocol.PSPayloadError` naming the worker: its stream is not trusted."""
        nbytes = [n * dtype.itemsize for n, dtype in sizes]
        buffers = [receive_buffer(n, self.reserve) for n in nbytes]
        self._send(rank, [self._answer(h, Msg.GRANT)], "sending a GRANT")
        # each counted as the granted message, not the reserve it may land in
        works = [self._post(functools.partial(self.comm.irecv, counted=n + TRAILER_BYTES), b,
                            rank, TAG_REQUEST_PAYLOAD, "granting a payload")
                 for b, n in zip(buffers, nbytes)]
        for work in works:
            yield from self._await(work, rank, "receiving a granted payload")
        self._settle(rank, "sending a GRANT")
        try:
            return [unseal(b, n, h.seq, i, dtype)
                    for i, (b, n, (_, dtype)) in enumerate(zip(buffers, nbytes, sizes))]
        except ProtocolError as exc:
            self.reply(rank, h, status=Status.BAD_PAYLOAD)
            raise PSPayloadError(f"{self.roles.describe(rank)} sent a bad payload with "
                                 f"{h.describe()}: {exc}", rank) from None

    def reply(self, rank: int, h: Header, *, status: int = Status.OK,
              payload: torch.Tensor | None = None, count: int | None = None, key: int | None = None,
              clock: int = 0) -> None:
        """Send the REPLY to ``h`` (then ``payload``, if any); ``count`` defaults to its size.
        Collected when the worker's next request arrives, or by :meth:`flush`."""
        n = count if count is not None else (payload.numel() if payload is not None else 0)
        messages = [self._answer(h, Msg.REPLY, status, n, clock, key)]
        if payload is not None:
            messages.append(seal(payload, h.seq, 0))
        self._send(rank, messages, f"sending the reply to {h.describe()}")

    def flush(self, rank: int) -> Gen:
        """Wait until every send to worker ``rank`` has completed (when no request follows)."""
        for work in self._unsettled.pop(rank, []):
            yield from self._await(work, rank, "receiving the last reply")

    def forget(self, rank: int) -> None:
        """Worker ``rank`` is lost: its sends in flight are never waited for."""
        self._unsettled.pop(rank, None)

    def exchange(self, rank: int, mine: torch.Tensor, theirs: torch.Tensor) -> Gen:
        """Swap ``mine`` for ``theirs`` (same size) with server ``rank``: the lower rank sends
        first, so the pair's messages match in posting order (NCCL's rule)."""
        doing = f"{self.name} exchanged the lost workers with it"
        posts: list[tuple[Callable[..., Work], torch.Tensor]] = [(self.comm.isend, mine),
                                                                 (self.comm.irecv, theirs)]
        if self.comm.rank > rank:
            posts.reverse()
        works = [self._post(start, t, rank, TAG_SERVERS, doing) for start, t in posts]
        for work in works:
            yield from self._await(work, rank, doing)

    def close(self) -> None:
        self.watcher.close()

    def _answer(self, h: Header, kind: Msg, status: int = Status.OK, count: int = 0,
                clock: int = 0, key: int | None = None) -> torch.Tensor:
        return Header(kind, self.comm.rank, key=h.key if key is None else key, count=count,
                      dtype=h.dtype, clock=clock, version=self._version(), seq=h.seq,
                      status=status).to_tensor()

    def _send(self, rank: int, messages: list[torch.Tensor], doing: str) -> None:
        tags = [TAG_REPLY, TAG_REPLY_PAYLOAD]
        self._unsettled.setdefault(rank, []).extend(
            self._post(self.comm.isend, m, rank, tags[min(i, 1)], doing)
            for i, m in enumerate(messages))

    def _settle(self, rank: int, doing: str) -> None:
        settle(self._unsettled.get(rank, []), self.roles.describe(rank), rank, doing)

    def _post(self, start: Callable[..., Work], tensor: torch.Tensor, rank: int, tag: int,
              doing: str) -> Work:
        # no check-in round when a connection breaks: the peer is named at once (a server
        # that outlives a worker must not wait for ranks that have no reason to check in)
        return post(lambda: start(tensor, rank, tag, check_in=False), self.roles.describe(rank),
                    rank, doing)

    def _await(self, work: Any, rank: int, doing: str, timeout_s: float | None = None) -> Gen:
        watch = self.watcher.watch(work)
        peer = self.roles.describe(rank)
        yield on_watch(watch, timeout_s or self.timeout_s, peer, rank, doing,
                       self.comm.peer_died)
        finish(watch, peer, rank, doing)
