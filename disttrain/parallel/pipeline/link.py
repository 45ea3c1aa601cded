"""Messages between neighbouring pipeline stages: one message per activation or gradient.

Activations go to stage s+1 and gradients to stage s−1, each as one message, a 128-byte
header then the tensor's bytes (:mod:`.wire`). With v model chunks per rank (interleaved
1F1B) the stages form a ring: the last stage's activations go on to stage 0, whose next
chunk takes them, and the gradients come back the same way. The header is what keeps a
broken pipeline from hanging or corrupting silently:

* call number, mode and micro-batch number (and the receiving chunk) are checked against
  what the receiver's own schedule expects, so ranks running different schedules,
  micro-batch counts or steps get an error naming both stages, not a wrong pairing of
  tensors;
* train activations, eval activations and gradients each travel on a channel of their
  own, so a stage evaluating while its neighbour trains waits (and times out naming both
  stages) instead of receiving a message of a size it did not post (Gloo aborts the
  process on that);
* shape and dtype travel with every tensor, so nothing is declared ahead and a stage whose
  output changed shape cannot be misread;
* a message that ends short of the buffer posted for it is refused, not read past its end
  (:func:`.wire.mark_end`), and so, on Gloo, is one longer than expected: it lands in room
  reserved past the buffer's end instead of aborting the process (:mod:`.landing`);
* a stage that fails sends ``status = FAILED`` to its neighbours, who raise
  :class:`StageFailedError` at their next receive and pass it on, instead of each waiting
  for a timeout;
* ``value`` carries one float64: gradient headers carry the loss known so far, so the loss
  travels from the last stage to all others with the gradients (no collective to hang in).

**Channels.** An *edge* joins stage e to stage e + 1 (edge p − 1, the ring's wrap, joins
the last stage to stage 0); activations cross it one way and gradients the other. A
channel is one kind of message on one edge: a tag of the pipeline's communicator where
tags keep messages apart (Gloo, shared memory), and a two-rank sub-communicator of its own
(``Communicator.new_group``) where they do not: NCCL has no tags, matches a pair's messages in
the order they are posted, and runs each rank's sends and receives to one peer one after
the other, each waiting for its match (``Transport.in_order``;
:mod:`disttrain.comm.nccl_rules` enforces the same on Gloo). On a channel only one stage
sends and only its neighbour receives, in the same order on both sides, so no receive can
block a send queued behind it, whatever the schedule; with both directions on one
communicator, 1F1B's steady state would deadlock there (each stage's next send queued
behind a receive the other stage serves only after its own send). The shared-memory
transport advances a rank's messages only while that rank waits on the same transport,
which is why it keeps tags on one communicator. A group of two per pair, rather than one
group of all stages per kind, is what a group bound to a device needs (NCCL runs all its
messages on one queue there: a stage's send to the next stage would wait behind its
receive from the previous one). On two stages the wrap joins the same pair as edge 0,
but in the other direction: its own sub-communicators keep the two streams apart. NCCL
creates a pair's communicator on a channel at its first message there, and that call
blocks until the neighbour's own first message on it; a stage's first call is a receive,
of an activation on one channel for stage 1 and of a gradient on another for stage 0, so
each pair connects on every channel as the channels open, in one order on every stage
(edges ascending, the wrap last: ``Communicator.connect``), which cannot form a cycle.

**Sizes.** A receive needs a buffer of the message's exact size before the message arrives.
Both ends of a channel remember the payload size of the message at each *position* (the
k-th message of a train or eval call in that direction) and expect the same next time: in
steady state every tensor is one message, and the receive of the next message is posted as
soon as the previous one is read (the first when a call begins, :meth:`StageLink.begin`),
so it lands while the stage computes. When the size changed (the first call, a new batch
size) the sender fills the expected size with a ``RESHAPE`` header and sends the payload
alone right after; the receiver, which has posted nothing beyond that header, posts the
payload's receive next: in the order sent. Both ends then remember the new size. Bytes on
the wire in the first call equal those of every later one.

Sends are posted and not waited for (``isend``: the schedule never blocks on a send, which
is what :mod:`.schedule_check` assumes); :meth:`StageLink.flush` waits for them at the end of a
call, so no message outlives the call that sent it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from disttrain.comm import CommError, Communicator, Work
from disttrain.parallel.pipeline import wire
from disttrain.parallel.pipeline.landing import Landing, Posted
from disttrain.parallel.pipeline.wire import (
    DTYPES,
    EVAL,
    FAILED,
    HEADER_BYTES,
    MAX_NDIM,
    OK,
    RESHAPE,
    TRAIN,
    Header,
    PipelineError,
)

__all__ = ["DTYPES", "EVAL", "HEADER_BYTES", "MAX_NDIM", "TRAIN", "Direction", "Message",
           "PipelineError", "StageFailedError", "StageLink"]

log = logging.getLogger(__name__)


class StageFailedError(PipelineError):
    """A neighbouring stage reported that it failed (its own error is in its log)."""

    def __init__(self, message: str, stage: int) -> None:
        super().__init__(message)
        self.stage = stage


class Direction(enum.Enum):
    """Activations go forward to stage s+1; gradients go backward to stage s−1."""

    ACTIVATION = 0
    GRADIENT = 1

    @property
    def noun(self) -> str:
        return "activation" if self is Direction.ACTIVATION else "gradient"


Channel = tuple[Communicator, int, int]  # (communicator, tag, the neighbour's rank there)
Channels = Mapping[tuple[Direction, int, int], Channel]  # (direction, mode, edge)
_TAG_BASE = 0x7100  # user point-to-point tags; collectives use tags far above
_KINDS = ((Direction.ACTIVATION, TRAIN), (Direction.ACTIVATION, EVAL),
          (Direction.GRADIENT, TRAIN))  # eval calls send no gradients


def open_channels(comm: Communicator, stage: int, ring: bool = False
                  ) -> dict[tuple[Direction, int, int], Channel]:
    """The channels of a pipeline's messages by (direction, mode, edge): a tag each on
    ``comm``, or, where the transport matches in posting order whatever the tags, a
    two-rank sub-communicator per edge and kind, each connected as it is made (module
    doc). ``ring``: the stages form a ring (edge p − 1 joins the last stage to stage 0).
    Collective: every stage of ``comm`` calls it; stage s is rank s."""
    stages = comm.world_size
    # edges ascending, the wrap last: one order of groups and first contacts on every
    # stage, which cannot cycle
    edges = [e for e in range(stages if ring and stages > 1 else stages - 1)
             if stage in (e, (e + 1) % stages)]
    channels: dict[tuple[Direction, int, int], Channel] = {}
    for i, kind in enumerate(_KINDS):
        for e in edges:
            peer = (e + 1) % stages if stage == e else e
            if not comm.transport.in_order:
                channels[(*kind, e)] = (comm, _TAG_BASE + i, peer)
                continue
            pair = comm.new_group(sorted((e, (e + 1) % stages)))  # ranks ascending
            assert pair is not None  # a member
            pair.connect([1 - pair.rank])
            channels[(*kind, e)] = (pair, 0, 1 - pair.rank)
    for e in edges:
        channels[(Direction.GRADIENT, EVAL, e)] = channels[(Direction.GRADIENT, TRAIN, e)]
    return channels


@dataclass(frozen=True)
class Message:
    """A received activation or gradient, with what its header said about it."""

    tensor: torch.Tensor
    rows: int
    value: float
    bundle: bool = False  # ``tensor`` is a bundle of tensors to unpack (.bundle)


@dataclass
class _Channel:
    """One direction of messages to (or from) one neighbour during the current call."""

    sizes: dict[tuple[int, int], int] = field(default_factory=dict)  # (mode, position) → bytes
    mode: int = TRAIN
    position: int = 0  # messages sent (received) so far in this call
    count: int = 0  # messages this call sends (receives)
    posted: deque[Posted] = field(default_factory=deque)  # receives posted, in order

    def begin(self, mode: int, count: int) -> None:
        self.mode, self.position, self.count = mode, 0, count

    def expected(self, position: int) -> int:
        """Payload bytes both ends expect at ``position`` (0, header only, the first time)."""
        return self.sizes.get((self.mode, position), 0)


def _mode_name(mode: int) -> str:
    return "train" if mode == TRAIN else "eval"


_CHUNK_SHIFT = 32  # a header's micro-batch field: micro-batch + receiving chunk · 2³²


def _what(direction: Direction, microbatch: int, mode: int, call: int, chunk: int = 0) -> str:
    target = f" for chunk {chunk}" if chunk else ""
    return (f"the {direction.noun} of micro-batch {microbatch}{target} ({_mode_name(mode)} "
            f"call {call})")


class StageLink:
    """Stage ``stage``'s messages with stages ``stage − 1`` and ``stage + 1`` (``ring``:
    modulo p, for interleaved schedules); the pipeline communicator's rank r is stage r.
    Every call (train step or evaluation) starts with :meth:`begin`, which says how many
    messages go each way. Building one is collective (every stage opens the channels);
    received tensors are put on ``device``."""

    def __init__(self, comm: Communicator, stage: int, device: torch.device | None = None,
                 channels: Channels | None = None, ring: bool = False) -> None:
        self.comm = comm
        self.stage = stage
        self.num_stages = comm.world_size
        self.ring = ring
        self.channels = (channels if channels is not None
                         else open_channels(comm, stage, ring))
        self.device = device if device is not None else torch.device("cpu")
        self.wire = comm.device  # where messages live: where the communicator moves bytes
        self.pending: list[tuple[Work, int, str, torch.Tensor]] = []  # sends in flight
        self._out = {d: _Channel() for d in Direction}
        self._in = {d: _Channel() for d in Direction}
        self.orphans: list[Work] = []  # messages abandoned by a failure, kept alive
        self.landing = Landing(comm)  # receive buffers, one landing region per direction
        self.wait_s = 0.0  # time blocked waiting for messages, since begin()
        self._told_on: Direction | None = None  # where a failure notice came in

    def describe(self, stage: int) -> str:
        """``stage 2 (rank 5)``: the stage and its global rank."""
        return f"stage {stage} (rank {self.comm.global_ranks[stage]})"

    def neighbour(self, offset: int) -> int:
        """The stage ``offset`` (±1) away: round the ring if there is one (off a chain's
        ends, −1 or p: no stage)."""
        peer = self.stage + offset
        return peer % self.num_stages if self.ring else peer

    def _peer(self, direction: Direction, sending: bool) -> int:
        forward = direction is Direction.ACTIVATION
        return self.neighbour(1 if forward == sending else -1)

    def communicators(self) -> list[Communicator]:
        """The channels' communicators (their byte counts are the pipeline's traffic)."""
        return list({id(c): c for c, _, _ in self.channels.values()}.values())

    def begin(self, mode: int, sends: Mapping[Direction, int],
              recvs: Mapping[Direction, int]) -> None:
        """Start a call: this stage will send ``sends[d]`` and receive ``recvs[d]`` messages
        in direction ``d``. Posts the first receive each way now, sized as the same position
        last time."""
        self.wait_s = 0.0
        for direction in Direction:
            self._out[direction].begin(mode, sends.get(direction, 0))
            channel = self._in[direction]
            channel.begin(mode, recvs.get(direction, 0))
            if channel.count:
                self._post_recv(direction, 0)

    def _channel(self, direction: Direction, mode: int, sending: bool) -> Channel:
        """The channel on the edge to the neighbour: activations sent and gradients
        received cross this stage's own edge, the others the previous stage's."""
        own = (direction is Direction.ACTIVATION) == sending
        edge = self.stage if own else (self.stage - 1) % self.num_stages
        return self.channels[(direction, mode, edge)]

    def _post_recv(self, direction: Direction, position: int) -> None:
        channel = self._in[direction]
        channel.posted.append(self._post(direction, HEADER_BYTES + channel.expected(position),
                                         f"the next {direction.noun}"))

    def _post(self, direction: Direction, size: int, what: str) -> Posted:
        """Post the receive of the next ``size``-byte message in ``direction``."""
        peer = self._peer(direction, sending=False)
        chan = self._channel(direction, self._in[direction].mode, sending=False)
        return self.landing.post(direction, size, self._in[direction].posted,
                                 lambda buffer, counted: self._irecv(chan, buffer, peer, what,
                                                                     counted))

    def _irecv(self, channel: Channel, buffer: torch.Tensor, peer: int, what: str,
               counted: int | None = None) -> Work:
        try:
            return channel[0].irecv(buffer, channel[2], channel[1], counted=counted)
        except CommError as exc:  # refused at once: the connection to the peer is closed
            raise PipelineError(f"{self.describe(self.stage)} could not wait for {what} from "
                                f"{self.describe(peer)}: {exc}") from exc

    def _isend(self, channel: Channel, tensor: torch.Tensor, peer: int, what: str) -> None:
        try:
            work = channel[0].isend(tensor, channel[2], channel[1])
        except CommError as exc:  # refused at once: the connection to the peer is closed
            raise PipelineError(f"{self.describe(self.stage)} could not send {what} to "
                                f"{self.describe(peer)}: {exc}") from exc
        self.pending.append((work, peer, what, tensor))

    def send(self, direction: Direction, tensor: torch.Tensor, *, call: int, mode: int,
             microbatch: int, rows: int, value: float = 0.0, bundle: bool = False,
             chunk: int = 0) -> None:
        """Post ``tensor`` with its header to the neighbour in ``direction`` (``bundle``:
        it holds a packed tuple, list or dict of tensors; ``chunk``: the receiver's)."""
        if not isinstance(tensor, torch.Tensor):
            raise PipelineError(f"{self.describe(self.stage)} must send one tensor as its "
                                f"{direction.noun}, got {type(tensor).__name__}; pipeline "
                                f"stages exchange single tensors")
        if tensor.dim() > MAX_NDIM or tensor.dtype not in DTYPES:
            raise PipelineError(f"{self.describe(self.stage)}: cannot send a {direction.noun} "
                                f"of shape {tuple(tensor.shape)} and dtype {tensor.dtype} (at "
                                f"most {MAX_NDIM} dimensions, dtypes {DTYPES})")
        channel = self._out[direction]
        peer = self._peer(direction, sending=True)
        what = _what(direction, microbatch, mode, call, chunk)
        header = Header(OK, call, mode, microbatch + (chunk << _CHUNK_SHIFT), rows, value,
                        tensor.dtype, tuple(tensor.shape), bundle)
        key = (channel.mode, channel.position)
        expected = channel.expected(channel.position)
        chan = self._channel(direction, channel.mode, sending=True)
        if header.nbytes == expected:
            self._isend(chan, wire.pack(header, tensor, expected, self.wire), peer, what)
        else:  # fill the receiver's buffer with the news, then send the payload alone
            self._isend(chan, wire.pack(replace(header, status=RESHAPE), None, expected,
                                        self.wire), peer, what)
            self._isend(chan, wire.as_bytes(tensor, self.wire), peer, what)
            channel.sizes[key] = header.nbytes
        channel.position += 1

    def recv(self, direction: Direction, *, call: int, mode: int, microbatch: int,
             chunk: int = 0) -> Message:
        """Wait for the next ``direction`` message and check that it is the one this stage's
        schedule expects (for this stage's ``chunk``)."""
        channel = self._in[direction]
        peer = self._peer(direction, sending=False)
        what = _what(direction, microbatch, mode, call, chunk)
        if not channel.posted:  # more receives than begin() announced
            self._post_recv(direction, channel.position)
        posted = channel.posted.popleft()
        self._wait(posted.work, peer, what)
        buffer = self._whole(posted, peer, what)
        header = self._check(Header.unpack(buffer), peer, what,
                             (call, mode, microbatch + (chunk << _CHUNK_SHIFT)), direction)
        if header.status == RESHAPE:  # the payload is the next message on this channel
            posted = self._post(direction, header.nbytes, what)
            self._wait(posted.work, peer, what)
            buffer, offset = self._whole(posted, peer, what), 0
            channel.sizes[(channel.mode, channel.position)] = header.nbytes
        elif header.nbytes == buffer.numel() - HEADER_BYTES:
            offset = HEADER_BYTES
        else:
            raise PipelineError(f"{self.describe(self.stage)} received {what} with "
                                f"{header.nbytes} bytes of payload in a message of "
                                f"{buffer.numel()} bytes: the ranks run different versions")
        # out of a landing region before its next receive is posted; in place otherwise
        tensor = wire.view_payload(buffer, offset, header).to(self.device, copy=posted.reused)
        channel.position += 1
        if channel.position < channel.count and not channel.posted:  # the next one lands
            self._post_recv(direction, channel.position)  # while this one is computed on
        return Message(tensor, header.rows, header.value, header.bundle)

    def _whole(self, posted: Posted, peer: int, what: str) -> torch.Tensor:
        """The message ``posted`` received, once it is known to have filled the bytes posted
        for it (what it did not fill would be read as data) and not gone on past them."""
        how = posted.fault()
        if how is None:
            return posted.message()
        raise PipelineError(f"{self.describe(self.stage)} received {what} from "
                            f"{self.describe(peer)} {how} the {posted.size} bytes posted for "
                            f"it; it was not used (the ranks run different versions, or "
                            f"another sender used the pipeline's tags)")

    def _check(self, header: Header, peer: int, what: str, expected: tuple[int, int, int],
               direction: Direction | None = None) -> Header:
        if header.status == FAILED:
            if not 0 <= header.microbatch < self.num_stages:
                raise PipelineError(f"{self.describe(self.stage)} received a failure notice "
                                    f"from {self.describe(peer)} naming stage "
                                    f"{header.microbatch} of {self.num_stages}: the ranks run "
                                    f"different versions")
            self._told_on = direction
            raise StageFailedError(f"{self.describe(self.stage)} stopped: "
                                   f"{self.describe(header.microbatch)} failed (its error is "
                                   f"in that rank's output)", header.microbatch)
        if (header.call, header.mode, header.microbatch) != expected:
            mb, chunk = header.microbatch % (1 << _CHUNK_SHIFT), header.microbatch >> _CHUNK_SHIFT
            got = (f"micro-batch {mb}{f' for chunk {chunk}' if chunk else ''} "
                   f"({_mode_name(header.mode)} call {header.call})")
            raise PipelineError(f"{self.describe(self.stage)} expected {what} from "
                                f"{self.describe(peer)} but received {got}: the ranks run "
                                f"different schedules, micro-batch counts or steps; every "
                                f"rank must use the same pipeline settings")
        return header

    def _wait(self, work: Work, peer: int, what: str) -> None:
        start = time.perf_counter()
        try:
            work.wait()
        except (CommError, ValueError) as exc:  # shm: ValueError when the size is wrong
            raise PipelineError(f"{self.describe(self.stage)} gave up waiting for {what} from "
                                f"{self.describe(peer)}: {exc}") from exc
        finally:
            self.wait_s += time.perf_counter() - start

    def flush(self) -> None:
        """Wait until every posted send has been received (with the communicator's timeout:
        a neighbour that failed after this stage's last receive is only noticed here)."""
        start = time.perf_counter()
        try:
            for work, peer, what, _ in self.pending:
                try:
                    work.wait()
                except (CommError, ValueError) as exc:  # shm: ValueError on a wrong size
                    raise PipelineError(f"{self.describe(self.stage)} gave up waiting for "
                                        f"{self.describe(peer)} to receive {what}; that stage "
                                        f"probably failed (see its error): {exc}") from exc
        finally:
            self.wait_s += time.perf_counter() - start
        self.pending.clear()

    def report_failure(self, exc: BaseException) -> None:
        """Tell the neighbours that a stage failed, without waiting: they raise
        :class:`StageFailedError` on their next receive and pass it on. A failure reported
        to us by a neighbour goes on to the other neighbour only (round a ring, notices go
        both ways and a stage may hear twice); one this stage raised itself (e.g. a replica
        of it failed) goes to both.

        The notice takes the place of the next message this call would have sent that way,
        at that message's expected size, so it fits the receive the neighbour posted. A
        neighbour this call has already sent everything to is not told (it waits for
        nothing more from us in this call; its next call times out naming this stage)."""
        skip: Direction | None = None  # not back to the neighbour that told us
        if isinstance(exc, StageFailedError) and exc.stage != self.stage:
            failed_stage = exc.stage
            told = self._told_on or (Direction.ACTIVATION if failed_stage < self.stage
                                     else Direction.GRADIENT)
            skip = Direction(1 - told.value)  # the other way over the same edge
        else:
            failed_stage = self.stage
        self.orphans += [work for work, _, _, _ in self.pending]
        self.pending = []
        for channel in self._in.values():
            self.orphans += [posted.work for posted in channel.posted]
            self.landing.abandon(channel.posted)
            channel.posted.clear()
        header = Header(FAILED, 0, 0, failed_stage, 0, 0.0, torch.int64, (0,))
        for direction, channel in self._out.items():
            peer = self._peer(direction, sending=True)
            if not 0 <= peer < self.num_stages or direction is skip:
                continue
            if channel.position >= channel.count:
                log.debug("stage %d: nothing left to send to stage %d this call; not told of "
                          "the failure", self.stage, peer)
                continue
            notice = wire.pack(header, None, channel.expected(channel.position), self.wire)
            try:
                comm, tag, there = self._channel(direction, channel.mode, sending=True)
                self.orphans.append(comm.isend(notice, there, tag))
            except CommError:  # this neighbour cannot be told (its connection is closed,
                continue  # or the communicator failed): the other one still may
