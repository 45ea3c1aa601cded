"""A worker's side of the protocol with one server: send a request, get its reply.

Request flow (see :mod:`.protocol`)::

    worker                                   server
      │── header (TAG_REQUEST) ───────────────►│ validate every field
      │◄─────────────────── GRANT (TAG_REPLY) ──│ only for requests with a payload
      │── payload(s) (TAG_REQUEST_PAYLOAD) ────►│ sizes agreed in the header
      │◄─────────────────── REPLY (TAG_REPLY) ──│ status; PULL may wait here (sync, ssp)
      │◄──────────── values (TAG_REPLY_PAYLOAD) ─│ only for an OK PULL / SPARSE_PULL

The reply-payload receive is posted only after an OK reply header has arrived, so a rejected
request never leaves a receive behind. Both sides post each message of a request in the
order of the flow above (a receive only after the sends before it): NCCL ignores the tags,
matches a pair's messages in posting order and runs them one after the other, so a reply
receive posted ahead of the request would wait for ever on the worker's own queue
(:mod:`disttrain.comm.nccl_rules`). The tags still name the four streams on Gloo.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.comm import Communicator, Work
from disttrain.parallel.parameter_server.errors import (
    ProtocolError,
    PSPeerFailedError,
    PSRejectedError,
)
from disttrain.parallel.parameter_server.poll import (
    Wait,
    Watcher,
    finish,
    on_watch,
    post,
    settle,
)
from disttrain.parallel.parameter_server.protocol import (
    TAG_REPLY,
    TAG_REPLY_PAYLOAD,
    TAG_REQUEST,
    TAG_REQUEST_PAYLOAD,
    Header,
    Msg,
    Status,
    decode_reply,
    empty_header,
    status_name,
)

Reply = Callable[[Header, "torch.Tensor | None"], None]


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
            sends += [self._post(self.comm.isend, p, TAG_REQUEST_PAYLOAD, doing)
                      for p in req.payloads]
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
            values = torch.empty(req.reply_elems, dtype=req.reply_dtype)
            yield from wait(self._post(self.comm.irecv, values, TAG_REPLY_PAYLOAD, doing), doing)
        return answer, values

    def _post(self, start: Callable[..., Work], tensor: torch.Tensor, tag: int,
              doing: str) -> Work:
        # a broken connection names the server at once (no check-in round)
        return post(lambda: start(tensor, self.rank, tag, check_in=False), self.peer,
                    self.rank, doing)

    def _await(self, work: Any, doing: str, timeout_s: float) -> Generator[Wait, None, None]:
        watch = self.watcher.watch(work)
        yield on_watch(watch, timeout_s, self.peer, self.rank, doing)
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
