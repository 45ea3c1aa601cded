"""Messages between neighbouring pipeline stages: one message per activation or gradient.

Activations go to stage s+1 and gradients to stage s−1 on the pipeline's communicator, each
as one message, a 128-byte header then the tensor's bytes (:mod:`.wire`). The header is what
keeps a broken pipeline from hanging or corrupting silently:

* call number, mode and micro-batch number are checked against what the receiver's own
  schedule expects, so ranks running different schedules, micro-batch counts or steps get
  an error naming both stages, not a wrong pairing of tensors;
* train and eval calls use their own tags, so a stage evaluating while its neighbour trains
  waits (and times out naming both stages) instead of receiving a message of a size it did
  not post (Gloo aborts the process on that);
* shape and dtype travel with every tensor, so nothing is declared ahead and a stage whose
  output changed shape cannot be misread;
* a stage that fails sends ``status = FAILED`` to its neighbours, who raise
  :class:`StageFailedError` at their next receive and pass it on, instead of each waiting
  for a timeout;
* ``value`` carries one float64: gradient headers carry the loss known so far, so the loss
  travels from the last stage to all others with the gradients (no collective to hang in).

**Sizes.** A receive needs a buffer of the message's exact size before the message arrives.
Both ends of a channel remember the payload size of the message at each *position* (the
k-th message of a train or eval call in that direction) and expect the same next time: in
steady state every tensor is one message, and receives are posted when a call begins
(:meth:`StageLink.begin`), so they land while the stage computes. When the size changed
(the first call, a new batch size) the sender fills the expected size with a ``RESHAPE``
header and sends the payload alone right after, on a second tag; both ends then remember
the new size. Bytes on the wire in the first call equal those of every later one.

Sends are posted and not waited for (``isend``: the schedule never blocks on a send, which
is what :mod:`simulate` assumes); :meth:`StageLink.flush` waits for them at the end of a
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
_TAG_BASE = 0x7100  # user point-to-point tags; collectives use tags far above


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

    def tags(self, mode: int) -> tuple[int, int]:
        """(message tag, tag of payloads that follow a RESHAPE header) of ``mode``'s calls.
        Train and eval calls use different tags: a message from a neighbour in the other
        mode never matches a receive this stage posted (whose size it need not fit, which
        Gloo punishes by aborting the process), so the wait times out naming both stages."""
        base = _TAG_BASE + 4 * mode + 2 * self.value
        return base, base + 1


@dataclass(frozen=True)
class Message:
    """A received activation or gradient, with what its header said about it."""

    tensor: torch.Tensor
    rows: int
    value: float


@dataclass
class _Channel:
    """One direction of messages to (or from) one neighbour during the current call."""

    sizes: dict[tuple[int, int], int] = field(default_factory=dict)  # (mode, position) → bytes
    mode: int = TRAIN
    position: int = 0  # messages sent (received) so far in this call
    count: int = 0  # messages this call sends (receives)
    posted: deque[tuple[torch.Tensor, Work]] = field(default_factory=deque)

    def begin(self, mode: int, count: int) -> None:
        self.mode, self.position, self.count = mode, 0, count

    def expected(self, position: int) -> int:
        """Payload bytes both ends expect at ``position`` (0, header only, the first time)."""
        return self.sizes.get((self.mode, position), 0)


def _mode_name(mode: int) -> str:
    return "train" if mode == TRAIN else "eval"


def _what(direction: Direction, microbatch: int, mode: int, call: int) -> str:
    return f"the {direction.noun} of micro-batch {microbatch} ({_mode_name(mode)} call {call})"


class StageLink:
    """Stage ``stage``'s messages with stages ``stage − 1`` and ``stage + 1``; the pipeline
    communicator's rank r is stage r. Every call (train step or evaluation) starts with
    :meth:`begin`, which says how many messages go each way."""

    def __init__(self, comm: Communicator, stage: int) -> None:
        self.comm = comm
        self.stage = stage
        self.num_stages = comm.world_size
        self.pending: list[tuple[Work, int, str, torch.Tensor]] = []  # sends in flight
        self._out = {d: _Channel() for d in Direction}
        self._in = {d: _Channel() for d in Direction}
        self.orphans: list[Work] = []  # messages abandoned by a failure, kept alive
        self.wait_s = 0.0  # time blocked waiting for messages, since begin()

    def describe(self, stage: int) -> str:
        """``stage 2 (rank 5)``: the stage and its global rank."""
        return f"stage {stage} (rank {self.comm.global_ranks[stage]})"

    def _peer(self, direction: Direction, sending: bool) -> int:
        forward = direction is Direction.ACTIVATION
        return self.stage + (1 if forward == sending else -1)

    def begin(self, mode: int, sends: Mapping[Direction, int],
              recvs: Mapping[Direction, int]) -> None:
        """Start a call: this stage will send ``sends[d]`` and receive ``recvs[d]`` messages
        in direction ``d``. Posts every receive now, sized as the same position last time."""
        self.wait_s = 0.0
        for direction in Direction:
            self._out[direction].begin(mode, sends.get(direction, 0))
            channel = self._in[direction]
            channel.begin(mode, recvs.get(direction, 0))
            for position in range(channel.count):
                self._post_recv(direction, position)

    def _post_recv(self, direction: Direction, position: int) -> None:
        channel = self._in[direction]
        buffer = torch.empty(HEADER_BYTES + channel.expected(position), dtype=torch.uint8)
        peer = self._peer(direction, sending=False)
        tag = direction.tags(channel.mode)[0]
        channel.posted.append((buffer, self._irecv(buffer, peer, tag,
                                                   f"the next {direction.noun}")))

    def _irecv(self, buffer: torch.Tensor, peer: int, tag: int, what: str) -> Work:
        try:
            return self.comm.irecv(buffer, peer, tag)
        except CommError as exc:  # refused at once: the connection to the peer is closed
            raise PipelineError(f"{self.describe(self.stage)} could not wait for {what} from "
                                f"{self.describe(peer)}: {exc}") from exc

    def _isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        try:
            work = self.comm.isend(tensor, peer, tag)
        except CommError as exc:  # refused at once: the connection to the peer is closed
            raise PipelineError(f"{self.describe(self.stage)} could not send {what} to "
                                f"{self.describe(peer)}: {exc}") from exc
        self.pending.append((work, peer, what, tensor))

    def send(self, direction: Direction, tensor: torch.Tensor, *, call: int, mode: int,
             microbatch: int, rows: int, value: float = 0.0) -> None:
        """Post ``tensor`` with its header to the neighbour in ``direction``."""
        if not isinstance(tensor, torch.Tensor):
            raise PipelineError(f"{self.describe(self.stage)} must send one tensor as its "
                                f"{direction.noun}, got {type(tensor).__name__}; pipeline "
                                f"stages exchange single tensors")
        if tensor.dim() > MAX_NDIM or tensor.dtype not in DTYPES or tensor.device.type != "cpu":
            raise PipelineError(f"{self.describe(self.stage)}: cannot send a {direction.noun} "
                                f"of shape {tuple(tensor.shape)}, dtype {tensor.dtype} on "
                                f"{tensor.device} (at most {MAX_NDIM} dimensions, dtypes "
                                f"{DTYPES}, CPU)")
        channel = self._out[direction]
        peer = self._peer(direction, sending=True)
        what = _what(direction, microbatch, mode, call)
        header = Header(OK, call, mode, microbatch, rows, value, tensor.dtype,
                        tuple(tensor.shape))
        key = (channel.mode, channel.position)
        expected = channel.expected(channel.position)
        tags = direction.tags(channel.mode)
        if header.nbytes == expected:
            self._isend(wire.pack(header, tensor, expected), peer, tags[0], what)
        else:  # fill the receiver's buffer with the news, then send the payload alone
            self._isend(wire.pack(replace(header, status=RESHAPE), None, expected), peer,
                        tags[0], what)
            self._isend(wire.as_bytes(tensor), peer, tags[1], what)
            channel.sizes[key] = header.nbytes
        channel.position += 1

    def recv(self, direction: Direction, *, call: int, mode: int, microbatch: int) -> Message:
        """Wait for the next ``direction`` message and check that it is the one this stage's
        schedule expects."""
        channel = self._in[direction]
        peer = self._peer(direction, sending=False)
        what = _what(direction, microbatch, mode, call)
        if not channel.posted:  # more receives than begin() announced
            self._post_recv(direction, channel.position)
        buffer, work = channel.posted.popleft()
        self._wait(work, peer, what)
        header = self._check(Header.unpack(buffer), peer, what, (call, mode, microbatch))
        if header.status == RESHAPE:
            buffer, offset = torch.empty(header.nbytes, dtype=torch.uint8), 0
            tag = direction.tags(channel.mode)[1]
            self._wait(self._irecv(buffer, peer, tag, what), peer, what)
            channel.sizes[(channel.mode, channel.position)] = header.nbytes
        elif header.nbytes == buffer.numel() - HEADER_BYTES:
            offset = HEADER_BYTES
        else:
            raise PipelineError(f"{self.describe(self.stage)} received {what} with "
                                f"{header.nbytes} bytes of payload in a message of "
                                f"{buffer.numel()} bytes: the ranks run different versions")
        channel.position += 1
        return Message(wire.view_payload(buffer, offset, header), header.rows, header.value)

    def _check(self, header: Header, peer: int, what: str,
               expected: tuple[int, int, int]) -> Header:
        if header.status == FAILED:
            if not 0 <= header.microbatch < self.num_stages:
                raise PipelineError(f"{self.describe(self.stage)} received a failure notice "
                                    f"from {self.describe(peer)} naming stage "
                                    f"{header.microbatch} of {self.num_stages}: the ranks run "
                                    f"different versions")
            raise StageFailedError(f"{self.describe(self.stage)} stopped: "
                                   f"{self.describe(header.microbatch)} failed (its error is "
                                   f"in that rank's output)", header.microbatch)
        if (header.call, header.mode, header.microbatch) != expected:
            got = (f"micro-batch {header.microbatch} ({_mode_name(header.mode)} call "
                   f"{header.call})")
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
        to us by a neighbour goes on to the other neighbour only; one this stage raised
        itself (e.g. a replica of it failed) goes to both.

        The notice takes the place of the next message this call would have sent that way,
        at that message's expected size, so it fits the receive the neighbour posted. A
        neighbour this call has already sent everything to is not told (it waits for
        nothing more from us in this call; its next call times out naming this stage)."""
        if isinstance(exc, StageFailedError) and exc.stage != self.stage:
            failed_stage = exc.stage
            skip: int | None = self.stage - 1 if failed_stage < self.stage else self.stage + 1
        else:
            failed_stage, skip = self.stage, None
        self.orphans += [work for work, _, _, _ in self.pending]
        self.pending = []
        for channel in self._in.values():
            self.orphans += [work for _, work in channel.posted]
            channel.posted.clear()
        header = Header(FAILED, 0, 0, failed_stage, 0, 0.0, torch.int64, (0,))
        for direction, channel in self._out.items():
            peer = self._peer(direction, sending=True)
            if not 0 <= peer < self.num_stages or peer == skip:
                continue
            if channel.position >= channel.count:
                log.debug("stage %d: nothing left to send to stage %d this call; not told of "
                          "the failure", self.stage, peer)
                continue
            notice = wire.pack(header, None, channel.expected(channel.position))
            try:
                tag = direction.tags(channel.mode)[0]
                self.orphans.append(self.comm.isend(notice, peer, tag))
            except CommError:  # this neighbour cannot be told (its connection is closed,
                continue  # or the communicator failed): the other one still may
