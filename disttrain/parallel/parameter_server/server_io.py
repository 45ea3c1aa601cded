"""The server's side of the message flow (the worker's side is :mod:`.channel`).

Every receive is watched (:class:`~.poll.Watcher`) and awaited with the server's deadline,
so a worker that stops talking is named by role and rank, never waited on forever. Sends
to a worker are collected when its next message arrives, which proves they completed
(:func:`~.poll.settle`), or awaited explicitly by :meth:`ServerIO.flush` when none follows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import Any

import torch

from disttrain.comm import Communicator, Work
from disttrain.parallel.parameter_server.errors import PSError
from disttrain.parallel.parameter_server.poll import (
    Wait,
    Watch,
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
    TAG_SERVERS,
    Header,
    Msg,
    Status,
    empty_header,
)
from disttrain.parallel.parameter_server.roles import PSRoles

Gen = Generator[Wait, None, Any]


class ServerIO:
    """Receive requests and payloads from workers, send GRANTs and REPLYs to them."""

    def __init__(self, comm: Communicator, roles: PSRoles, timeout_s: float,
                 version: Callable[[], int]) -> None:
        self.comm, self.roles, self.timeout_s = comm, roles, timeout_s
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
        yield on_watch(watch, timeout_s or self.timeout_s, peer, rank, doing)
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
        """GRANT request ``h``, then receive its payloads (sizes already validated). The
        receives come after the GRANT, in the order the worker sends (see :mod:`.channel`)."""
        buffers = [torch.empty(n, dtype=dtype) for n, dtype in sizes]
        self._send(rank, [self._answer(h, Msg.GRANT)], "sending a GRANT")
        works = [self._post(self.comm.irecv, b, rank, TAG_REQUEST_PAYLOAD, "granting a payload")
                 for b in buffers]
        for work in works:
            yield from self._await(work, rank, "receiving a granted payload")
        self._settle(rank, "sending a GRANT")
        return buffers

    def reply(self, rank: int, h: Header, *, status: int = Status.OK,
              payload: torch.Tensor | None = None, count: int | None = None, key: int | None = None,
              clock: int = 0) -> None:
        """Send the REPLY to ``h`` (then ``payload``, if any); ``count`` defaults to its size.
        Collected when the worker's next request arrives, or by :meth:`flush`."""
        n = count if count is not None else (payload.numel() if payload is not None else 0)
        messages = [self._answer(h, Msg.REPLY, status, n, clock, key)]
        if payload is not None:
            messages.append(payload)
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
        posts = [(self.comm.isend, mine), (self.comm.irecv, theirs)]
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
        yield on_watch(watch, timeout_s or self.timeout_s, peer, rank, doing)
        finish(watch, peer, rank, doing)
