"""Messages between neighbouring pipeline stages: a small header, then the tensor.

Every activation (to stage s+1) and gradient (to stage s−1) travels as two point-to-point
messages on the pipeline's communicator::

    header  int64[15] = magic, status, call, mode, micro-batch, rows, value, dtype, ndim,
                        shape[6]
    payload the tensor itself (contiguous), shape and dtype as announced

The header is what keeps a broken pipeline from hanging or corrupting silently:

* the receiver allocates exactly the announced shape, so no shape has to be declared ahead
  and a stage whose output changed shape cannot overrun a pre-sized buffer;
* call number, mode and micro-batch number are checked against what the receiver's own
  schedule expects, so ranks running different schedules, micro-batch counts or steps get
  an error naming both stages, not a wrong pairing of tensors;
* a stage that fails sends ``status = FAILED`` headers to its neighbours, who raise
  :class:`StageFailedError` at their next receive and pass it on, instead of each waiting
  for a timeout.

``value`` carries one float64 along: gradient headers carry the loss known so far, so the
loss travels from the last stage to all others with the gradients (no collective, and no
collective to hang in when a stage fails).

Sends are posted and not waited for (``isend``: the schedule never blocks on a send, which
is what :mod:`simulate` assumes); :meth:`StageLink.flush` waits for them at the end of a
step, so no message outlives the step that sent it (a send abandoned before the receiver
took it would be lost). Receives block, with the communicator's timeout, and the header
receives a step will need are posted when it starts (:meth:`StageLink.expect`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

import torch

from disttrain.comm import CommError, Communicator, Work

HEADER_LEN = 15
MAX_NDIM = HEADER_LEN - 9
_MAGIC = 0x5049_5045
OK, FAILED = 0, 1
TRAIN, EVAL = 0, 1
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_TAG_BASE = 0x7100  # user point-to-point tags; collectives use tags far above


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the stages (and ranks) involved."""


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


def _float_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64)[0])


def _bits_float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64)[0])


@dataclass(frozen=True)
class Header:
    """What precedes every tensor. A ``FAILED`` header names the failed stage in
    ``microbatch`` and carries nothing after it."""

    status: int
    call: int
    mode: int
    microbatch: int
    rows: int  # rows of the micro-batch at stage 0, carried along for validation
    value: float  # the loss known so far, on gradient messages
    dtype: torch.dtype
    shape: tuple[int, ...]

    def encode(self) -> torch.Tensor:
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        return torch.tensor([_MAGIC, self.status, self.call, self.mode, self.microbatch,
                             self.rows, _float_bits(self.value), DTYPES.index(self.dtype),
                             len(self.shape), *shape], dtype=torch.int64)

    @staticmethod
    def decode(t: torch.Tensor) -> Header:
        v = t.tolist()
        if v[0] != _MAGIC or not 0 <= v[7] < len(DTYPES) or not 0 <= v[8] <= MAX_NDIM:
            raise PipelineError(f"received a malformed pipeline header {v}: another message "
                                f"used the pipeline's tags, or the ranks run different versions")
        return Header(v[1], v[2], v[3], v[4], v[5], _bits_float(v[6]), DTYPES[v[7]],
                      tuple(v[9:9 + v[8]]))


@dataclass(frozen=True)
class Message:
    """A received activation or gradient, with what its header said about it."""

    tensor: torch.Tensor
    rows: int
    value: float


def _mode_name(mode: int) -> str:
    return "train" if mode == TRAIN else "eval"


class StageLink:
    """Stage ``stage``'s messages with stages ``stage − 1`` and ``stage + 1``; the pipeline
    communicator's rank r is stage r."""

    def __init__(self, comm: Communicator, stage: int) -> None:
        self.comm = comm
        self.stage = stage
        self.num_stages = comm.world_size
        self.pending: list[tuple[Work, int, str]] = []  # sends in flight: work, peer, what
        self._posted: dict[Direction, deque[tuple[torch.Tensor, Work]]] = {
            d: deque() for d in Direction}
        self.orphans: list[Work] = []  # messages abandoned by a failure, kept alive

    def describe(self, stage: int) -> str:
        """``stage 2 (rank 5)``: the stage and its global rank."""
        return f"stage {stage} (rank {self.comm.global_ranks[stage]})"

    def _peer(self, direction: Direction, sending: bool) -> int:
        forward = direction is Direction.ACTIVATION
        return self.stage + (1 if forward == sending else -1)

    @staticmethod
    def _tags(direction: Direction) -> tuple[int, int]:
        base = _TAG_BASE + 2 * direction.value
        return base, base + 1

    def send(self, direction: Direction, tensor: torch.Tensor, *, call: int, mode: int,
             microbatch: int, rows: int, value: float = 0.0) -> None:
        """Post the header and the tensor to the neighbour in ``direction``."""
        if not isinstance(tensor, torch.Tensor):
            raise PipelineError(f"{self.describe(self.stage)} must send one tensor as its "
                                f"{direction.noun}, got {type(tensor).__name__}; pipeline "
                                f"stages exchange single tensors")
        if tensor.dim() > MAX_NDIM or tensor.dtype not in DTYPES:
            raise PipelineError(f"{self.describe(self.stage)}: cannot send a {direction.noun} "
                                f"of shape {tuple(tensor.shape)} and dtype {tensor.dtype} "
                                f"(at most {MAX_NDIM} dimensions, dtypes {DTYPES})")
        payload = tensor.detach().contiguous()
        header = Header(OK, call, mode, microbatch, rows, value, payload.dtype,
                        tuple(payload.shape))
        peer = self._peer(direction, sending=True)
        header_tag, payload_tag = self._tags(direction)
        what = f"the {direction.noun} of micro-batch {microbatch} ({_mode_name(mode)} call {call})"
        for tensor_, tag in ((header.encode(), header_tag), (payload, payload_tag)):
            self.pending.append((self.comm.isend(tensor_, peer, tag), peer, what))

    def recv(self, direction: Direction, *, call: int, mode: int, microbatch: int) -> Message:
        """Wait for the next ``direction`` message and check that it is the one this stage's
        schedule expects."""
        peer = self._peer(direction, sending=False)
        header_tag, payload_tag = self._tags(direction)
        what = f"the {direction.noun} of micro-batch {microbatch} ({_mode_name(mode)} call {call})"
        posted = self._posted[direction]
        if posted:
            raw, work = posted.popleft()
        else:
            raw = torch.zeros(HEADER_LEN, dtype=torch.int64)
            work = self.comm.irecv(raw, peer, header_tag)
        self._wait(work, peer, what)
        header = Header.decode(raw)
        if header.status == FAILED:
            raise StageFailedError(f"{self.describe(self.stage)} stopped: "
                                   f"{self.describe(header.microbatch)} failed (its error is "
                                   f"in that rank's output)", header.microbatch)
        got = (f"micro-batch {header.microbatch} ({_mode_name(header.mode)} call "
               f"{header.call})")
        if (header.call, header.mode, header.microbatch) != (call, mode, microbatch):
            raise PipelineError(f"{self.describe(self.stage)} expected {what} from "
                                f"{self.describe(peer)} but received {got}: the ranks run "
                                f"different schedules, micro-batch counts or steps; every "
                                f"rank must use the same pipeline settings")
        tensor = torch.empty(header.shape, dtype=header.dtype)
        self._wait(self.comm.irecv(tensor, peer, payload_tag), peer, what)
        return Message(tensor, header.rows, header.value)

    def expect(self, direction: Direction, count: int) -> None:
        """Post the header receives of the next ``count`` ``direction`` messages now (the
        schedule says how many will come), so headers land while this stage computes and
        the sender's header never waits for the receiver to reach its receive."""
        peer = self._peer(direction, sending=False)
        for _ in range(count):
            raw = torch.zeros(HEADER_LEN, dtype=torch.int64)
            self._posted[direction].append((raw, self.comm.irecv(raw, peer,
                                                                 self._tags(direction)[0])))

    def _wait(self, work: Work, peer: int, what: str) -> None:
        try:
            work.wait()
        except CommError as exc:
            raise PipelineError(f"{self.describe(self.stage)} gave up waiting for {what} from "
                                f"{self.describe(peer)}: {exc}") from exc

    def flush(self) -> None:
        """Wait until every posted send has been received (with the communicator's timeout:
        a neighbour that failed after this stage's last receive is only noticed here)."""
        for work, peer, what in self.pending:
            try:
                work.wait()
            except CommError as exc:
                raise PipelineError(f"{self.describe(self.stage)} gave up waiting for "
                                    f"{self.describe(peer)} to receive {what}; that stage "
                                    f"probably failed (see its error): {exc}") from exc
        self.pending.clear()

    def report_failure(self, exc: BaseException) -> None:
        """Tell the neighbours that a stage failed, without waiting: they raise
        :class:`StageFailedError` on their next receive and pass it on. A failure reported
        to us by a neighbour goes on to the other neighbour only; one this stage raised
        itself (e.g. a replica of it failed) goes to both."""
        if isinstance(exc, StageFailedError) and exc.stage != self.stage:
            failed_stage = exc.stage
            skip: int | None = self.stage - 1 if failed_stage < self.stage else self.stage + 1
        else:
            failed_stage, skip = self.stage, None
        self.orphans += [work for work, _, _ in self.pending]
        self.orphans += [work for d in Direction for _, work in self._posted[d]]
        self.pending = []
        self._posted = {d: deque() for d in Direction}
        header = Header(FAILED, 0, 0, failed_stage, 0, 0.0, torch.int64, ())
        for direction in Direction:
            peer = self._peer(direction, sending=True)
            if 0 <= peer < self.num_stages and peer != skip:
                try:
                    work = self.comm.isend(header.encode(), peer, self._tags(direction)[0])
                except CommError:  # the communicator itself failed: nothing more to tell
                    return
                self.orphans.append(work)
