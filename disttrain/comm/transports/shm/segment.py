"""The shared-memory segment: its layout (pure data), creation, attachment, liveness checks,
and sharing it among the ranks of a group.

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

The segment's name is unlinked as soon as every rank has attached (see below); the
mappings stay valid until the processes exit. Every rank knows the name before the segment
exists, so when a rank is killed during set-up (its resource tracker, which would remove
it, dies with its process group) the others' failed exchange removes it, under any
launcher. Should every rank die at once, ``disttrain launch`` and ``disttrain run`` tag
their ranks' segments and remove what is left of them (:func:`unlink_tagged`).

**Sharing a segment** among the ranks of a group (:func:`share_segment`): name, create,
attach, unlink, over torch.distributed. Used for the transport's own segment and for shared
buffers (``transport.py``)::

    every rank             ← broadcast of a fresh name from rank 0 (Gloo)
    rank 0                 create it, write the header (int64 words at 0)
    every rank             ← broadcast of "created"
    every rank             attach, check the header, ``attached(segment)`` (publish a pid, …)
    every rank             → all-gather of "attached" statuses; unlink the name

Once every rank has attached (or given up) the name is removed, so a crash can never leave a
file in /dev/shm: the mappings live until the processes exit. A failure on any rank raises
:class:`ShmUnavailableError` on every rank, naming the ranks that failed.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from disttrain.comm.errors import CommError, CommTimeoutError, PeerFailedError
from disttrain.comm.liveness import host_key as host_key
from disttrain.comm.liveness import is_alive as is_alive
from disttrain.comm.liveness import process_start_time as process_start_time
from disttrain.comm.transports.torch_p2p import TorchTransport, translate_error

log = logging.getLogger(__name__)
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
    Returns the names removed. Only this user's regular files are touched; an entry that
    is not (another user's, a directory) or cannot be removed is left with a warning: the
    clean-up of a run, even a successful one, never fails because of it."""
    if not tag:
        return []
    prefix = f"{NAME_PREFIX}{tag}-"
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(prefix))
    except OSError:
        return []  # no /dev/shm here: no names to leak either
    removed = []
    for name in names:
        try:
            info = os.lstat(os.path.join(directory, name))
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise PermissionError("not a segment of this user's")
            unlink_name(name)
        except OSError as exc:
            log.warning("left %s in %s: %s", name, directory, exc)
            continue
        removed.append(name)
    return removed


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


# ----------------------------------------------- sharing a segment among ranks
_NAME_BYTES = 48
_CHECK_IN_GRACE_S = 5.0  # how long a failed set-up waits for the other ranks to check in


class ShmUnavailableError(RuntimeError):
    """Shared memory cannot connect these ranks (raised on every rank alike)."""


def setup_failure(what: str, group: Any, timeout_s: float | None,
                  exc: BaseException) -> CommError:
    """The named error for a set-up exchange over ``group`` that failed with torch's
    ``exc``: which step, on which rank, and the ranks that did not check in afterwards
    (through the rendezvous store, as a failed collective finds its culprit), by global
    rank."""
    translated = translate_error(exc)
    where = f"shared-memory transport set-up on global rank {dist.get_rank()}: {what}"
    missing: list[int] | None = None
    try:
        torch_view = TorchTransport(group, timeout_s or _CHECK_IN_GRACE_S)
        gone = torch_view.unresponsive_ranks(min(_CHECK_IN_GRACE_S, timeout_s or
                                                 _CHECK_IN_GRACE_S))
        if gone is not None:
            missing = [torch_view.global_ranks[r] for r in gone]
    except Exception:  # a diagnosis aid: it must never mask the real error
        missing = None
    blame = (f"global ranks {missing} did not check in afterwards" if missing else
             "every rank checked in afterwards" if missing == [] else
             "which rank is missing could not be found out")
    suspects = tuple(missing or ())
    if isinstance(translated, TimeoutError):
        waited = f" after {timeout_s:g}s" if timeout_s is not None else ""
        return CommTimeoutError(f"{where} timed out{waited}; {blame} ({exc})",
                                op="shm_setup", suspects=suspects)
    if isinstance(translated, ConnectionError):
        return PeerFailedError(f"{where}: a connection broke (a rank died or left); {blame} "
                               f"({exc})", op="shm_setup",
                               peer=suspects[0] if suspects else None, suspects=suspects)
    return CommError(f"{where} failed: {exc}")


def _exchange(what: str, group: Any, timeout_s: float | None,
              start: Callable[[], Any]) -> None:
    """One set-up collective: ``start()`` posts it (``async_op=True``), then it is waited
    for at most ``timeout_s`` (None: the process group's own timeout). Torch's errors
    become :func:`setup_failure`'s named ones."""
    try:
        work = start()
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise setup_failure(what, group, timeout_s, exc) from exc


def check_same_host(group: Any, timeout_s: float | None = None) -> None:
    """Raise :class:`ShmUnavailableError` on every rank unless all share memory and pids
    (a rank that is missing or dead: :func:`setup_failure`'s error, within ``timeout_s``)."""
    members = dist.get_process_group_ranks(group)  # all_gather's order
    mine = torch.tensor(list(host_key()), dtype=torch.uint8)
    keys = [torch.empty_like(mine) for _ in members]
    _exchange("exchanging host keys", group, timeout_s,
              lambda: dist.all_gather(keys, mine, group=group, async_op=True))
    first = keys[0]
    others = [g for g, key in zip(members, keys, strict=True) if not torch.equal(key, first)]
    if others:
        raise ShmUnavailableError(
            f"ranks {others} (global) are not on the same host (or mount/pid/network "
            f"namespace) as global rank {members[0]}; shared memory cannot connect them: use "
            "the 'torch' transport (or 'auto', which picks it)")


def share_segment(group: Any, global_ranks: Sequence[int], rank: int, size: int,
                  header: Sequence[int],
                  attached: Callable[[AttachedSegment], None] | None = None,
                  timeout_s: float | None = None) -> tuple[AttachedSegment, str]:
    """Rank 0 creates a ``size``-byte segment starting with ``header``; everyone attaches,
    checks the header and calls ``attached`` (which may raise OSError/ValueError to refuse);
    the name is unlinked on every rank before this returns, also when an exchange fails
    (each waits at most ``timeout_s``; None: the process group's timeout)."""
    msg = torch.zeros(1 + _NAME_BYTES, dtype=torch.int64)  # [len(name), name bytes...]
    if rank == 0:
        encoded = list(new_segment_name().encode())
        msg[0], msg[1 : 1 + len(encoded)] = len(encoded), torch.tensor(encoded)
    # The name travels before the segment exists: whichever rank dies during set-up, the
    # others know what to remove (torchrun, srun and mpirun tag no names for a launcher)
    _exchange("sending the segment's name", group, timeout_s,
              lambda: dist.broadcast(msg, global_ranks[0], group=group, async_op=True))
    name = bytes(int(b) for b in msg[1 : 1 + int(msg[0])]).decode()
    creator, error, shm = None, "", None
    try:
        if rank == 0:
            creator, error = _create(name, size, header)
        created = torch.tensor([int(rank != 0 or creator is not None)])
        _exchange("telling whether the segment was created", group, timeout_s,
                  lambda: dist.broadcast(created, global_ranks[0], group=group, async_op=True))
        if int(created) != 1:
            raise ShmUnavailableError(f"rank 0 could not create a shared-memory segment "
                                      f"{'(' + error + ')' if error else '(see its log)'}")
        try:  # every rank, the creator included, maps the segment the same way
            shm = attach_segment(name)
            _check_header(shm, header)
            if attached is not None:
                attached(shm)
        except (OSError, ValueError) as exc:
            error = f"rank {rank}: {exc}"
        statuses = [torch.zeros(1, dtype=torch.int64) for _ in global_ranks]
        mine = torch.tensor([0 if error else 1])
        _exchange("gathering who attached the segment", group, timeout_s,
                  lambda: dist.all_gather(statuses, mine, group=group, async_op=True))
    finally:
        # Everyone attached (or gave up, or an exchange failed: a rank died): the name is
        # no longer needed. Every rank removes it, so on every rank it is gone when this
        # returns (rank 0 also tells its resource tracker, which would otherwise remove it
        # at exit).
        if creator is not None:
            destroy(creator)
        unlink_name(name)
    members = dist.get_process_group_ranks(group)
    failed = [g for g, s in zip(members, statuses, strict=True) if int(s) != 1]
    if failed or shm is None:
        raise ShmUnavailableError(f"global ranks {failed} could not attach shared-memory segment "
                                  f"{name}" + (f": {error}" if error else ""))
    return shm, name


def _create(name: str, size: int, header: Sequence[int]) -> tuple[Any, str]:
    """Rank 0: create the segment ``name`` and write its header; (segment, "") or (None,
    the error)."""
    try:
        creator = create_segment(name, size)
        np.frombuffer(segment_buffer(creator), dtype=np.int64, count=len(header))[:] = header
    except OSError as exc:
        return None, str(exc)
    return creator, ""


def _check_header(shm: AttachedSegment, header: Sequence[int]) -> None:
    found = [int(x) for x in np.frombuffer(segment_buffer(shm), dtype=np.int64,
                                           count=len(header))]
    if found != list(header):
        raise ValueError(f"segment header {found} does not match this rank's {list(header)}: "
                         f"every rank must use the same ShmConfig and allocate the same "
                         f"shared buffers in the same order")


def segment_buffer(shm: Any) -> memoryview:
    buf = shm.buf
    if buf is None:
        raise RuntimeError("shared-memory segment is closed")
    return buf  # type: ignore[no-any-return]
