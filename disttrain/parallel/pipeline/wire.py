"""The pipeline's wire format: one message per tensor, a 128-byte header in front of the bytes.

::

    message  = header (16 × 8 bytes, little-endian) | payload (the tensor's bytes)
    header   = magic, status, call, mode, micro-batch, rows, value (float64), dtype, ndim,
               shape[6], payload bytes

A payload is one tensor, or a *bundle* (:mod:`.bundle`: a tuple, list or dict of tensors
packed into bytes), which the dtype field says with a code of its own.

Header and payload travel in *one* message (one ``isend``, one ``irecv``): point-to-point
messages cost a fixed ~0.1-0.5 ms each on Gloo, which for small activations is most of a
pipeline's communication time. The receiver must post a buffer of the right size before the
message arrives, so :mod:`.link` keeps, on both sides of each channel, the payload size of
the previous message at the same position of the same kind of call, and the header says
when that guess was wrong (``status = RESHAPE``: the payload follows in a second message).
The payload starts at byte 128, a multiple of every dtype's size, so it is viewed in place (on
Gloo, copied out of the landing region its receive reuses; see **Whole messages**).
A message lives where the communicator moves bytes (``Communicator.device``: host memory for
Gloo and shared memory, the GPU for NCCL); the header is packed and read on the host.

**Whole messages.** Gloo fills a posted receive with a shorter message without saying how
much arrived, which would leave the rest of the buffer (heap bytes of earlier tensors) to be
read as activations or gradients. So a receive buffer in host memory has its last 8 bytes
set to a random value before it is posted (:func:`mark_end`), and the message is used only
if they changed (:func:`ends_whole`): a message that ends short leaves them, one that
arrived whole overwrote them (equal to the mark by chance with probability 2⁻⁶⁴). It costs
no byte on the wire, which a trailer would (and the pipeline's byte counts are exact). A
payload of under 8 bytes sent alone (after ``RESHAPE``) is not checked: the mark would match
too often. Gloo aborts the process on a message longer than the receive posted for it, so on
Gloo the receive is posted into a region with room past the expected end
(:mod:`.landing`) and the 8 bytes past the end are marked too: a message that
changed them went on too long (one k < 8 bytes too long goes unnoticed, cut at the expected
end, with probability 2⁻⁸ᵏ: the bytes it wrote there equal the mark's). Buffers
on the GPU are not marked: under NCCL a receive larger than its send does not complete (the
communicator's timeout names the peer), and a smaller one has been seen to complete with
the message cut (NVIDIA/nccl#1938), which nothing here detects.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import numpy
import torch

HEADER_BYTES = 128
MAX_NDIM = 6
_FORMAT = struct.Struct("<qqqqqqdqq6qq")  # 16 fields of 8 bytes: see the module docstring
_MAGIC = 0x5049_5045
OK, FAILED, RESHAPE = 0, 1, 2  # RESHAPE: the payload was not the size the receiver expected
STATUSES = (OK, FAILED, RESHAPE)
TRAIN, EVAL = 0, 1
MODES = (TRAIN, EVAL)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_INDEX = {dtype: i for i, dtype in enumerate(DTYPES)}
_BUNDLE = len(DTYPES)  # the dtype code of a bundle: bytes to unpack, not a tensor
assert _FORMAT.size == HEADER_BYTES


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the stages (and ranks) involved."""


@dataclass(frozen=True)
class Header:
    """What precedes every payload. A ``FAILED`` header names the failed stage in
    ``microbatch`` and carries nothing after it."""

    status: int
    call: int
    mode: int
    microbatch: int
    rows: int  # rows of the micro-batch at stage 0, carried along for validation
    value: float  # the loss known so far, on gradient messages
    dtype: torch.dtype
    shape: tuple[int, ...]
    bundle: bool = False  # the payload is a bundle of tensors (uint8 bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the payload the header describes."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize

    def pack_into(self, buffer: torch.Tensor) -> None:
        """Write the header into the first 128 bytes of a uint8 CPU ``buffer``."""
        shape = list(self.shape) + [0] * (MAX_NDIM - len(self.shape))
        _FORMAT.pack_into(buffer.numpy().data, 0, _MAGIC, self.status, self.call, self.mode,
                          self.microbatch, self.rows, self.value,
                          _BUNDLE if self.bundle else _DTYPE_INDEX[self.dtype],
                          len(self.shape), *shape, self.nbytes)

    @staticmethod
    def unpack(buffer: torch.Tensor) -> Header:
        """Read and check the header at the start of ``buffer``: the magic number, a known
        status, mode and dtype, at most :data:`MAX_NDIM` sizes, none negative, and a payload
        size they make."""
        if buffer.device.type != "cpu":  # a message on the GPU: read its header on the host
            buffer = buffer[:HEADER_BYTES].cpu()
        v = _FORMAT.unpack_from(buffer.numpy().data, 0)
        magic, status, call, mode, microbatch, rows, value, dtype, ndim = v[:9]
        shape = tuple(v[9:9 + ndim]) if 0 <= ndim <= MAX_NDIM else (-1,)
        if magic != _MAGIC or status not in STATUSES or mode not in MODES or not (
                0 <= dtype <= _BUNDLE) or any(d < 0 for d in shape):
            raise PipelineError(f"received a malformed pipeline header {list(v)}: another "
                                f"message used the pipeline's tags, or the ranks run different "
                                f"versions")
        bundle = dtype == _BUNDLE
        header = Header(status, call, mode, microbatch, rows, value,
                        torch.uint8 if bundle else DTYPES[dtype], shape, bundle)
        if header.nbytes != v[15]:
            raise PipelineError(f"received a pipeline header whose shape {header.shape} and "
                                f"dtype {header.dtype} do not make its {v[15]} payload bytes")
        return header


def pack(header: Header, tensor: torch.Tensor | None, payload_bytes: int,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """One message on ``device``: ``header`` then ``tensor``'s bytes (``tensor`` None:
    ``payload_bytes`` of zeros, to fill a buffer of the size the receiver posted)."""
    message = torch.empty(HEADER_BYTES + payload_bytes, dtype=torch.uint8, device=device)
    if message.device.type == "cpu":
        header.pack_into(message)
    else:  # packed on the host, then one small copy
        host = torch.empty(HEADER_BYTES, dtype=torch.uint8)
        header.pack_into(host)
        message[:HEADER_BYTES].copy_(host)
    if tensor is None:
        message[HEADER_BYTES:].zero_()
    elif payload_bytes:
        # copy_ reads any strides: a non-contiguous tensor costs no extra copy
        message[HEADER_BYTES:].view(tensor.dtype).copy_(tensor.detach().reshape(-1))
    return message


def as_bytes(tensor: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """``tensor``'s bytes on ``device`` as a flat uint8 tensor (a view when it is contiguous
    and there already)."""
    return tensor.detach().to(device).contiguous().reshape(-1).view(torch.uint8)


MARK_BYTES = 8
_MARKS = random.Random()  # a fresh mark per receive: it only has to differ from a whole
# message's last 8 bytes, which no sender sees or chooses for it


def mark_end(buffer: torch.Tensor) -> bytes | None:
    """Set the last 8 bytes of a uint8 host ``buffer`` about to be posted for a receive to a
    random value and return it; None (nothing set) for a buffer on the GPU or under 8
    bytes."""
    if buffer.device.type != "cpu" or buffer.numel() < MARK_BYTES:
        return None
    mark = _MARKS.getrandbits(8 * MARK_BYTES).to_bytes(MARK_BYTES, "little")
    buffer.numpy()[-MARK_BYTES:] = numpy.frombuffer(mark, dtype=numpy.uint8)
    return mark


def ends_whole(buffer: torch.Tensor, mark: bytes | None) -> bool:
    """Whether the message received into ``buffer`` (marked with ``mark`` by
    :func:`mark_end`) filled it to its last byte."""
    return mark is None or buffer.numpy()[-MARK_BYTES:].tobytes() != mark


def untouched(room: torch.Tensor, mark: bytes | None) -> bool:
    """Whether the 8 bytes ``room`` past a message's end (marked with ``mark`` by
    :func:`mark_end`) are as marked: the message did not go on past its expected end."""
    return mark is None or room.numpy().tobytes() == mark


def view_payload(buffer: torch.Tensor, offset: int, header: Header) -> torch.Tensor:
    """The tensor ``header`` describes, viewed in place in ``buffer`` from byte ``offset``."""
    return buffer[offset:offset + header.nbytes].view(header.dtype).view(header.shape)
