"""The wire protocol: a fixed-size int64 header, then raw tensor payloads. Nothing is pickled.

Gloo point-to-point needs the receiver to know every message's size in advance, so each
message starts with a header of :data:`HEADER_FIELDS` int64 (96 bytes), always the same size:

    field          request (worker → server)                 reply (server → worker)
    -------------  ----------------------------------------  ---------------------------------
    MAGIC          0x44545053 ("DTPS")                       same
    VERSION        protocol version (2)                      same
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
so it never receives a byte it did not size and agree to, and a rejected request leaves no
stray payload behind in the transport (HTTP's ``Expect: 100-continue`` works the same way).
Every request gets exactly one REPLY; a REPLY with STATUS ≠ OK is a rejection, logged on the
server, which goes on serving. The exception is PEER_FAILED: a server that stops because a
peer failed answers the requests it holds (at a consistency gate, or a DONE) with it (KEY:
that rank). DONE (COUNT: the number of workers W) is answered once every worker is done or
lost and the servers agreed on who was lost: its reply carries W int64 flags, 1 for each
lost worker (:meth:`~.server.ParameterServer.serve`).
On Gloo, tags name the four streams (:data:`TAG_REQUEST` …); NCCL ignores tags and matches a
pair's messages in posting order, so both sides post every message of a request in the
order of the flow (:mod:`.channel`), which keeps the streams apart there too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from disttrain.parallel.parameter_server.errors import ProtocolError

MAGIC = 0x44545053  # "DTPS"
PROTOCOL_VERSION = 2
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
