"""Shared buffers: tensors that already live in shared memory, so a large all-reduce on them
reads the other ranks' data where it lies instead of copying it into the collective slots.

An all-reduce through the slots moves every byte several times: into the slot, through the
reduction, back out. When the tensor itself is in memory every rank has mapped, the copy in
disappears (and with it the copy that publishes the reduced segment). NCCL offers the same
idea as user-buffer registration (``ncclMemAlloc`` + ``ncclCommRegister``); DeepSpeed's
shared-memory all-reduce keeps its buffers in the segment for the same reason.

A shared buffer of n bytes is one segment holding p regions, one per rank::

    0          header line      magic, world size, region bytes, buffer index
    4096       region of rank 0   (n bytes, rounded up to whole pages)
    …          region of rank p−1

:meth:`SharedBuffers.zeros` is collective: every rank allocates the same sizes in the same
order and gets a zero-filled tensor over *its own* region. Algorithm ``shm`` then finds, for
a tensor, the buffer and byte offset it lies at (:meth:`find`), and reads the peers' regions
at the same offset. Nothing else changes: a shared tensor is an ordinary CPU tensor to every
other operation, and the other ranks read it only inside an all-reduce that every rank
entered with the same buffer and offset (checked, see ``shm_all_reduce.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from disttrain.comm.transports.shm_segment import PAGE, AttachedSegment, release

MAGIC = int.from_bytes(b"distbuf1", "little")

# share(size, header) → (the attached segment, its former name); collective, see
# shm_rendezvous.share_segment
Share = Callable[[int, Sequence[int]], tuple[AttachedSegment, str]]


@dataclass(frozen=True)
class SharedBuffer:
    """One allocation: every rank's region (bytes) and where this rank's region starts."""

    index: int
    region_bytes: int
    regions: list[torch.Tensor]  # uint8, rank order
    start: int  # data_ptr of this rank's region

    def views(self, offset: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's ``nbytes`` at byte ``offset`` of its region, as flat ``dtype``."""
        return [region[offset : offset + nbytes].view(dtype) for region in self.regions]


class SharedBuffers:
    """The shared buffers of one transport (allocated collectively, found by address)."""

    def __init__(self, rank: int, world_size: int, share: Share) -> None:
        self._rank, self._world_size, self._share = rank, world_size, share
        self._buffers: list[SharedBuffer] = []
        self._segments: list[AttachedSegment] = []
        self.names: list[str] = []  # the segments' names, all unlinked already (for tests)

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled flat tensor of ``numel`` ``dtype`` elements in this rank's region of
        a new shared buffer. Every rank must call this with the same arguments, in the same
        order (the segment header checks it)."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int ≥ 0, got {numel!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        region = max(PAGE, -(-nbytes // PAGE) * PAGE)
        index = len(self._buffers)
        header = [MAGIC, self._world_size, region, index]
        segment, name = self._share(PAGE + region * self._world_size, header)
        self._segments.append(segment)
        self.names.append(name)
        assert segment.buf is not None
        u8 = torch.frombuffer(segment.buf, dtype=torch.uint8)
        regions = [u8[PAGE + r * region : PAGE + (r + 1) * region]
                   for r in range(self._world_size)]
        mine = regions[self._rank]
        self._buffers.append(SharedBuffer(index, region, regions, mine.data_ptr()))
        tensor = mine[:nbytes].view(dtype)
        tensor.zero_()
        return tensor

    def find(self, tensor: torch.Tensor) -> tuple[SharedBuffer, int] | None:
        """(buffer, byte offset in this rank's region) when ``tensor`` lies wholly in one."""
        if not self._buffers:
            return None
        ptr = tensor.data_ptr()
        end = ptr + tensor.numel() * tensor.element_size()
        for buffer in self._buffers:
            if buffer.start <= ptr and end <= buffer.start + buffer.region_bytes:
                return buffer, ptr - buffer.start
        return None

    def __len__(self) -> int:
        return len(self._buffers)

    def close(self) -> None:
        """Forget the buffers and unmap what nothing points into any more (tensors the user
        still holds keep their mapping until the process exits; the names are long gone)."""
        self._buffers.clear()
        for segment in self._segments:
            release(segment)
        self._segments.clear()
