"""The ``shm`` transport: ranks on one machine exchange data through POSIX shared memory.

Loopback TCP (Gloo) costs milliseconds per small message on a busy machine; a copy into
memory every rank has mapped costs microseconds. This transport keeps torch.distributed
(Gloo) for what it is good at, the rendezvous, and moves every byte through one segment:

1. every rank all-gathers a hash of (host name, boot id, namespaces); unless all agree, the
   constructor raises :class:`ShmUnavailableError` on every rank (``make_transport("auto")``
   then falls back to the ``torch`` transport);
2. rank 0 creates the segment under a fresh name (``disttrain-shm-<random>``) and
   broadcasts the name; the others attach; everyone publishes its pid;
3. after an all-gather of "attached" statuses, rank 0 **unlinks** the name: the mappings
   live on until the processes exit, so nothing can leak in /dev/shm, even after SIGKILL.

Point-to-point messages (so every algorithm runs here) go through per-pair mailboxes
(``mailbox.py``); whole collectives (algorithm ``shm``) use the collective area
(``sync.py``). Layout and protocol: docs/shm_transport.md.

**Shared buffers** (:class:`SharedBuffers`, behind ``Communicator.shared_zeros``): tensors
that already live in shared memory, so a large all-reduce on them reads the other ranks'
data where it lies instead of copying it into the collective slots.

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
entered with the same buffer and offset (checked, see ``all_reduce.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from disttrain.comm.transport import DoneWork, RawWork, Transport
from disttrain.comm.transports import gloo_threads
from disttrain.comm.transports.shm.mailbox import Mailboxes
from disttrain.comm.transports.shm.segment import (
    LINE,
    PAGE,
    AttachedSegment,
    ShmLayout,
    ShmUnavailableError,
    check_same_host,
    release,
    segment_buffer,
    share_segment,
)
from disttrain.comm.transports.shm.sync import CollectiveArea, PeerTable
from disttrain.comm.transports.torch_p2p import TorchTransport

log = logging.getLogger(__name__)



@dataclass(frozen=True)
class ShmConfig:
    """Sizes of a shared-memory segment. The segment holds 2·p·slot_bytes of collective
    slots plus p·(p−1)·mailbox_slots·mailbox_slot_bytes of mailboxes, whatever the sizes of
    the messages (they stream through in rounds). Every rank must pass the same values.

    ``slot_bytes=None`` keeps the collective area at 16 MiB: 8 MiB / p per rank, between
    1 and 4 MiB (4 MiB for 2 ranks, 2 MiB for 4). Large rounds mean few barriers, which
    matters most when ranks share cores; the defaults need 17 MiB of /dev/shm for 2 ranks,
    22 MiB for 4 and 44 MiB for 8 (Docker's default /dev/shm is 64 MiB)."""

    slot_bytes: int | None = None  # per rank and buffer set: the bytes a round moves
    mailbox_slots: int = 4  # pieces in flight per (src, dst) pair
    mailbox_slot_bytes: int = 128 << 10  # one piece, including its 64-byte header
    one_shot_max_bytes: int = 256 << 10  # all_reduce up to this (and ≤ slot): one barrier

    def __post_init__(self) -> None:
        for name in ("slot_bytes", "mailbox_slot_bytes"):
            value = getattr(self, name)
            if name == "slot_bytes" and value is None:
                continue
            if not isinstance(value, int) or value < 4096 or value % LINE:
                raise ValueError(f"ShmConfig.{name} must be an int ≥ 4096 and a multiple of "
                                 f"{LINE} bytes, got {value!r}")
        if not isinstance(self.mailbox_slots, int) or self.mailbox_slots < 2:
            raise ValueError(f"ShmConfig.mailbox_slots must be ≥ 2 (one being filled while "
                             f"one is read), got {self.mailbox_slots!r}")
        if not isinstance(self.one_shot_max_bytes, int) or self.one_shot_max_bytes < 0:
            raise ValueError(f"ShmConfig.one_shot_max_bytes must be an int ≥ 0 (0: always "
                             f"stream), got {self.one_shot_max_bytes!r}")

    def slot_bytes_for(self, world_size: int) -> int:
        """The collective slot size for ``world_size`` ranks (see the class doc)."""
        if self.slot_bytes is not None:
            return self.slot_bytes
        per_rank = (8 << 20) // max(1, world_size)
        return min(4 << 20, max(1 << 20, per_rank // PAGE * PAGE))

    def layout(self, world_size: int) -> ShmLayout:
        slot = self.slot_bytes_for(world_size)
        if slot < 64 * (2 * world_size + 1):
            raise ValueError(f"ShmConfig.slot_bytes={slot} is too small for {world_size} "
                             f"ranks; use at least {64 * (2 * world_size + 1)}")
        return ShmLayout(world_size, slot, self.mailbox_slots, self.mailbox_slot_bytes)


class SharedMemoryTransport(Transport):
    """Point-to-point and whole collectives among the ranks of a torch.distributed group
    (default: WORLD) that all run on this machine. Create it on every rank of the group."""

    name = "shm"

    def __init__(self, group: Any | None = None, config: ShmConfig | None = None, *,
                 order: Sequence[int] | None = None, timeout_s: float = 1800.0) -> None:
        """``order``: the group's global ranks in the order that defines this transport's
        ranks (default: the group's order). ``timeout_s`` bounds sub-group creation and each
        set-up exchange (a rank missing there is named: ``segment.setup_failure``)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: the shared-memory transport uses it "
                "for the rendezvous; call torch.distributed.init_process_group('gloo') first")
        gloo_threads.tune_io_threads()  # the process's Gloo groups (see gloo_threads.py)
        self._group: Any = group if group is not None else dist.group.WORLD
        members = tuple(dist.get_process_group_ranks(self._group))
        if order is not None and sorted(order) != sorted(members):
            raise ValueError(f"order={list(order)} must list the group's ranks {members}")
        self._global_ranks = tuple(order) if order is not None else members
        self._sorted = self._global_ranks == members  # group rank i is transport rank i
        if dist.get_rank() not in self._global_ranks:
            raise ValueError("this process is not a member of the given process group")
        self._rank = self._global_ranks.index(dist.get_rank())
        self.timeout_s = timeout_s
        self.config = config or ShmConfig()
        self._layout = self.config.layout(len(self._global_ranks))
        check_same_host(self._group, timeout_s)
        layout = self._layout

        def register(shm: Any) -> None:  # publish this rank's pid before the name goes
            PeerTable(np.frombuffer(segment_buffer(shm), dtype=np.int64), layout,
                      self._rank).register()

        self._shm, self.segment_name = share_segment(
            self._group, self._global_ranks, self._rank, layout.size, layout.header(), register,
            timeout_s)
        buf = segment_buffer(self._shm)
        self._u8 = torch.frombuffer(buf, dtype=torch.uint8)
        self._i64 = np.frombuffer(buf, dtype=np.int64)
        self._peers = PeerTable(self._i64, self._layout, self._rank)
        self.mailboxes = Mailboxes(self._u8, self._i64, self._layout, self._rank, self._peers)
        self._collectives = CollectiveArea(self._u8, buf, self._layout, self._rank, self._peers,
                                          min(self.config.one_shot_max_bytes,
                                              self._layout.slot_bytes))
        self.buffers = SharedBuffers(self._rank, self.world_size, self._share)
        self._closed = False
        log.debug("rank %d: shared-memory segment %s, %.1f MiB", self._rank, self.segment_name,
                  self._layout.size / 2**20)

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._global_ranks)

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self._global_ranks

    @property
    def native_group(self) -> Any | None:
        """The Gloo group of the rendezvous: ``native`` (torch's own collectives) stays
        available, so a benchmark can compare both in one run. None when this transport
        orders its ranks differently from the group (torch's results would be permuted)."""
        if self._closed:
            raise RuntimeError("the shared-memory transport is closed")
        return self._group if self._sorted else None

    @property
    def layout(self) -> ShmLayout:
        return self._layout

    @property
    def collectives(self) -> CollectiveArea:
        """The collective slots and barrier that algorithm ``shm`` works on."""
        if self._closed:
            raise RuntimeError("the shared-memory transport is closed")
        return self._collectives

    def _share(self, size: int, header: Sequence[int]) -> Any:
        return share_segment(self._group, self._global_ranks, self._rank, size, header,
                             timeout_s=self.timeout_s)

    def shared_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor in shared memory that a large ``shm`` all-reduce reduces where
        it lies (no copy into the slots). Collective: every rank, same arguments, same order."""
        if self._closed:
            raise RuntimeError("the shared-memory transport is closed")
        return self.buffers.zeros(numel, dtype)

    def shares_usefully(self, nbytes: int) -> bool:
        """Whether an all-reduce of ``nbytes`` gains from a shared buffer: above the one-shot
        size (which copies once into a slot and needs one step) it skips two copies."""
        return nbytes > self._collectives.one_shot_max_bytes

    def zeros(self, numel: int, dtype: torch.dtype, only_if_useful: bool = False
              ) -> torch.Tensor:
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if only_if_useful and not self.shares_usefully(nbytes):
            return super().zeros(numel, dtype)
        return self.shared_zeros(numel, dtype)

    # ------------------------------------------------------------------ messages
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> RawWork:
        data = self._bytes(tensor, "dst", dst)
        return DoneWork() if data.numel() == 0 else self.mailboxes.isend(data, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> RawWork:
        data = self._bytes(tensor, "src", src)
        return DoneWork() if data.numel() == 0 else self.mailboxes.irecv(data, src, tag)

    def _bytes(self, tensor: torch.Tensor, what: str, peer: int) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("the shared-memory transport is closed")
        if not 0 <= peer < self.world_size or peer == self._rank:
            raise ValueError(f"{what}={peer} must be another rank in 0..{self.world_size - 1}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("the shared-memory transport moves contiguous CPU tensors only")
        return tensor.detach().reshape(-1).view(torch.uint8)

    def tune_io(self, workload: str) -> None:
        gloo_threads.tune_io_threads(workload)  # docs/architecture.md: Gloo's I/O threads

    def subgroup(self, ranks: Sequence[int]) -> SharedMemoryTransport | None:
        """A transport with its own segment over ranks ``ranks`` (members only; rank i of
        the new transport is ``ranks[i]`` here). The Gloo group for its rendezvous is made
        by :meth:`TorchTransport.subgroup`, which handles torch's group-naming pitfalls."""
        if self._rank not in ranks:
            return None
        group_ranks = [dist.get_group_rank(self._group, self._global_ranks[r]) for r in ranks]
        sub = TorchTransport(self._group, self.timeout_s).subgroup(group_ranks)
        assert sub is not None  # this rank is a member
        return SharedMemoryTransport(sub.native_group, self.config,
                                     order=[self._global_ranks[r] for r in ranks],
                                     timeout_s=self.timeout_s)

    def unresponsive_ranks(self, grace_s: float) -> list[int] | None:
        """Ranks known to be dead or closed (checked at once: the pids are in the segment),
        or None when all look alive (then a late rank is stuck, not dead)."""
        gone = [r for r in range(self.world_size) if not self._peers.responsive(r)]
        return gone or None

    def close(self) -> None:
        """Tell peers this rank is gone (they stop waiting for it) and unmap the segment."""
        if self._closed:
            return
        self._closed = True
        self._group = None  # destroy_process_group frees it now, not at interpreter exit
        self._peers.mark_closed()
        self._collectives.close()
        self.buffers.close()
        del self._u8, self._i64, self.mailboxes, self._collectives, self._peers
        if not release(self._shm):
            log.debug("shared-memory segment still referenced; unmapped at process exit")


# -------------------------------------------------------------- shared buffers
BUFFER_MAGIC = int.from_bytes(b"distbuf1", "little")

# share(size, header) → (the attached segment, its former name); collective, see
# segment.share_segment
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
        header = [BUFFER_MAGIC, self._world_size, region, index]
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


__all__ = ["SharedMemoryTransport", "ShmConfig", "ShmUnavailableError"]
