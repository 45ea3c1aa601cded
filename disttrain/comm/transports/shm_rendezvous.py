"""Sharing a segment among the ranks of a group: create, attach, unlink, over torch.distributed.

Used for the transport's own segment (``shm.py``) and for shared buffers (``shm_buffers.py``)::

    rank 0                 create under a fresh name, write the header (int64 words at 0)
    every rank             ← broadcast of the name (Gloo)
    every rank             attach, check the header, ``attached(segment)`` (publish a pid, …)
    every rank             → all-gather of "attached" statuses; unlink the name

Once every rank has attached (or given up) the name is removed, so a crash can never leave a
file in /dev/shm: the mappings live until the processes exit. A failure on any rank raises
:class:`ShmUnavailableError` on every rank, naming the ranks that failed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from disttrain.comm.transports.shm_segment import (
    AttachedSegment,
    attach_segment,
    create_segment,
    destroy,
    host_key,
    new_segment_name,
    unlink_name,
)

_NAME_BYTES = 48


class ShmUnavailableError(RuntimeError):
    """Shared memory cannot connect these ranks (raised on every rank alike)."""


def check_same_host(group: Any) -> None:
    """Raise :class:`ShmUnavailableError` on every rank unless all share memory and pids."""
    members = dist.get_process_group_ranks(group)  # all_gather's order
    mine = torch.tensor(list(host_key()), dtype=torch.uint8)
    keys = [torch.empty_like(mine) for _ in members]
    dist.all_gather(keys, mine, group=group)
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
                  ) -> tuple[AttachedSegment, str]:
    """Rank 0 creates a ``size``-byte segment starting with ``header``; everyone attaches,
    checks the header and calls ``attached`` (which may raise OSError/ValueError to refuse);
    the name is unlinked on every rank before this returns."""
    msg = torch.zeros(2 + _NAME_BYTES, dtype=torch.int64)  # [ok, len(name), name bytes...]
    creator, error = _create(size, header, msg) if rank == 0 else (None, "")
    dist.broadcast(msg, global_ranks[0], group=group)
    if int(msg[0]) != 1:
        raise ShmUnavailableError(f"rank 0 could not create a shared-memory segment "
                                  f"{'(' + error + ')' if error else '(see its log)'}")
    name = bytes(int(b) for b in msg[2 : 2 + int(msg[1])]).decode()
    shm = None
    try:  # every rank, the creator included, maps the segment the same way
        shm = attach_segment(name)
        _check_header(shm, header)
        if attached is not None:
            attached(shm)
    except (OSError, ValueError) as exc:
        error = f"rank {rank}: {exc}"
    statuses = [torch.zeros(1, dtype=torch.int64) for _ in global_ranks]
    dist.all_gather(statuses, torch.tensor([0 if error else 1]), group=group)
    # Everyone attached (or gave up): the name is no longer needed. Every rank removes it,
    # so on every rank it is gone when this returns (rank 0 also tells its resource
    # tracker, which would otherwise remove it at exit).
    if creator is not None:
        destroy(creator)
    unlink_name(name)
    members = dist.get_process_group_ranks(group)
    failed = [g for g, s in zip(members, statuses, strict=True) if int(s) != 1]
    if failed or shm is None:
        raise ShmUnavailableError(f"global ranks {failed} could not attach shared-memory segment "
                                  f"{name}" + (f": {error}" if error else ""))
    return shm, name


def _create(size: int, header: Sequence[int], msg: torch.Tensor) -> tuple[Any, str]:
    """Rank 0: create the segment, write its header, and put its name into ``msg``."""
    try:
        name = new_segment_name()
        creator = create_segment(name, size)
        np.frombuffer(segment_buffer(creator), dtype=np.int64, count=len(header))[:] = header
    except OSError as exc:
        return None, str(exc)
    encoded = list(name.encode())
    msg[:2] = torch.tensor([1, len(encoded)])
    msg[2 : 2 + len(encoded)] = torch.tensor(encoded)
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
