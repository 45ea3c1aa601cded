"""The shared-memory segment: its layout (pure data), creation, attachment and liveness checks.

One POSIX shared-memory segment per transport, laid out in 64-byte cache lines so that
every counter has exactly one writer and no two writers share a line (no false sharing)::

    0      header line        magic, version, world size, sizes (written by rank 0)
    64     rank lines         per rank: [pid, start time, state], [arrive counter, intents],
                              [doorbell]
    ...    mailbox lines      per ordered pair (src → dst): [head] line (src writes),
                              [tail] line (dst writes)
    4096·k collective slots   2 buffer sets × p ranks × slot_bytes      (set-major, rank-minor)
    ...    mailbox slots      p·(p−1) pairs × mailbox_slots × mailbox_slot_bytes,
                              each slot = 64-byte header [tag, total, offset, length] + payload

The size depends on the world size and the configured slot sizes, never on message sizes:
large messages stream through the fixed slots in rounds.

The segment's name is unlinked as soon as every rank has attached (see ``shm.py``); the
mappings stay valid until the processes exit. A rank killed between creating a segment and
that moment leaves the name behind (its resource tracker, which would remove it, is killed
with its process group), so launchers tag their ranks' segments and remove what is left of
them when the ranks are gone (:func:`unlink_tagged`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

# Who runs where, shared with the torch transport's failure diagnosis.
from disttrain.comm.liveness import host_key as host_key
from disttrain.comm.liveness import is_alive as is_alive
from disttrain.comm.liveness import process_start_time as process_start_time

LINE = 64  # bytes per cache line: every counter lives alone on one
PAGE = 4096
MAGIC = int.from_bytes(b"distshm1", "little")  # identifies a disttrain segment
VERSION = 2
SLOT_HEADER = LINE  # mailbox slot header: tag, total bytes, offset, piece length
NAME_PREFIX = "disttrain-shm-"
SHM_TAG_VAR = "DISTTRAIN_SHM_TAG"  # set by launchers: the segments of their ranks

# Rank-line fields (int64 indices within the rank's first line).
PID, START_TIME, STATE = 0, 1, 2
STATE_ALIVE, STATE_CLOSED = 1, 2


@dataclass(frozen=True)
class ShmLayout:
    """Byte offsets of everything in a segment for ``world_size`` ranks (pure arithmetic)."""

    world_size: int
    slot_bytes: int
    mailbox_slots: int
    mailbox_slot_bytes: int

    @property
    def num_pairs(self) -> int:
        return self.world_size * (self.world_size - 1)

    def rank_line(self, rank: int) -> int:
        """Offset of rank ``rank``'s [pid, start time, state] line."""
        return LINE * (1 + 3 * rank)

    def arrive_line(self, rank: int) -> int:
        """Offset of rank ``rank``'s collective arrival counter."""
        return self.rank_line(rank) + LINE

    def doorbell_line(self, rank: int) -> int:
        """Offset of rank ``rank``'s doorbell: changed (and futex-woken) by any rank that
        publishes a message piece to it or frees space in a ring it sends through."""
        return self.rank_line(rank) + 2 * LINE

    def pair(self, src: int, dst: int) -> int:
        """Index of the ordered pair src → dst among the p·(p−1) mailboxes."""
        if src == dst:
            raise ValueError(f"no mailbox from rank {src} to itself")
        return src * (self.world_size - 1) + (dst - 1 if dst > src else dst)

    def head_line(self, pair: int) -> int:
        return LINE * (1 + 3 * self.world_size + 2 * pair)

    def tail_line(self, pair: int) -> int:
        return self.head_line(pair) + LINE

    @property
    def collective_offset(self) -> int:
        control = LINE * (1 + 3 * self.world_size + 2 * self.num_pairs)
        return -(-control // PAGE) * PAGE

    def slot(self, buffer_set: int, rank: int) -> int:
        """Offset of rank ``rank``'s collective slot in buffer set 0 or 1."""
        return self.collective_offset + (buffer_set * self.world_size + rank) * self.slot_bytes

    def region(self, buffer_set: int) -> int:
        """Offset of buffer set ``buffer_set``: p slots back to back, rank order."""
        return self.slot(buffer_set, 0)

    @property
    def mailbox_offset(self) -> int:
        return self.collective_offset + 2 * self.world_size * self.slot_bytes

    def mailbox_slot(self, pair: int, index: int) -> int:
        """Offset of slot ``index`` (0..mailbox_slots−1) of mailbox ``pair`` (its header)."""
        return self.mailbox_offset + (pair * self.mailbox_slots + index) * self.mailbox_slot_bytes

    @property
    def size(self) -> int:
        end = self.mailbox_offset + self.num_pairs * self.mailbox_slots * self.mailbox_slot_bytes
        return -(-end // PAGE) * PAGE

    def header(self) -> list[int]:
        """What rank 0 writes in the header line and every other rank checks."""
        return [MAGIC, VERSION, self.world_size, self.slot_bytes, self.mailbox_slots,
                self.mailbox_slot_bytes, self.size]


def new_segment_name(environ: Mapping[str, str] | None = None) -> str:
    """A fresh name such as ``disttrain-shm-3f9c0a1b22de``; with the launcher's tag
    ($DISTTRAIN_SHM_TAG) ``disttrain-shm-<tag>-3f9c0a1b22de``, so that the launcher can
    remove what a rank killed during set-up left (:func:`unlink_tagged`)."""
    tag = (os.environ if environ is None else environ).get(SHM_TAG_VAR, "")
    if tag and not (tag.isascii() and tag.isalnum()):
        raise ValueError(f"{SHM_TAG_VAR}={tag!r} must be letters and digits only")
    return NAME_PREFIX + (f"{tag}-" if tag else "") + secrets.token_hex(6)


def unlink_tagged(tag: str, directory: str = "/dev/shm") -> list[str]:
    """Remove every segment named with launcher tag ``tag`` (see :func:`new_segment_name`):
    a name outlives set-up only if a rank died in the window between creating a segment
    and every rank attaching it, and then a launcher whose ranks are all gone removes it.
    Returns the names removed."""
    if not tag:
        return []
    prefix = f"{NAME_PREFIX}{tag}-"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return []  # no /dev/shm here: no names to leak either
    for name in names:
        unlink_name(name)
    return names


def create_segment(name: str, size: int) -> SharedMemory:
    """Create and reserve a segment. Pages are allocated now (``posix_fallocate``), so a full
    /dev/shm fails here with a clear error instead of a SIGBUS on first touch later."""
    shm = SharedMemory(name=name, create=True, size=size)
    try:
        fd: int = shm._fd  # type: ignore[attr-defined]  # kept open by SharedMemory on POSIX
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        destroy(shm)
        raise OSError(
            f"cannot reserve {size / 2**20:.1f} MiB in /dev/shm for the shared-memory "
            f"transport ({exc}); free space there, enlarge it (docker --shm-size), or lower "
            "ShmConfig.slot_bytes / mailbox_slot_bytes"
        ) from exc
    return shm


class AttachedSegment:
    """A segment another process created, mapped without involving multiprocessing's
    resource tracker. ``SharedMemory(name)`` would register it there (before Python 3.13,
    bpo-39959), and spawned ranks share their launcher's tracker, which would then
    unregister or unlink the creator's entry."""

    def __init__(self, name: str) -> None:
        import _posixshmem  # the module SharedMemory itself uses

        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf: memoryview | None = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; raises BufferError while tensors or arrays still point into the mapping."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None


def attach_segment(name: str) -> AttachedSegment:
    return AttachedSegment(name)


def unlink_name(name: str) -> None:
    """Remove ``name`` from /dev/shm if it is still there (any rank may; mappings survive)."""
    import _posixshmem

    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def unlink(shm: SharedMemory) -> None:
    """Remove the creator's name from /dev/shm (mappings stay valid) and drop the entry
    ``SharedMemory`` made in this process's resource tracker, even if another rank already
    removed the name (``SharedMemory.unlink`` would then raise before unregistering)."""
    try:
        shm.unlink()
    except FileNotFoundError:
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def destroy(shm: SharedMemory) -> None:
    unlink(shm)
    release(shm)


def release(shm: SharedMemory | AttachedSegment) -> bool:
    """Unmap if nothing still points into the mapping; False if something does (the
    mapping then lives until the process exits, which is harmless: the name is gone)."""
    try:
        shm.close()
    except BufferError:
        return False
    return True
