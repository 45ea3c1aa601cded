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

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from disttrain.comm.errors import CommError, CommTimeoutError, PeerFailedError
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
_CHECK_IN_GRACE_S = 5.0  # how long a failed set-up waits for the other ranks to check in


class ShmUnavailableError(RuntimeError):
    """Shared memory cannot connect these ranks (raised on every rank alike)."""


def setup_failure(what: str, group: Any, timeout_s: float | None,
                  exc: BaseException) -> CommError:
    """The named error for a set-up exchange over ``group`` that failed with torch's
    ``exc``: which step, on which rank, and the ranks that did not check in afterwards
    (through the rendezvous store, as a failed collective finds its culprit), by global
    rank."""
    from disttrain.comm.transports.torch_p2p import TorchTransport, translate_error

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
    msg = torch.zeros(2 + _NAME_BYTES, dtype=torch.int64)  # [ok, len(name), name bytes...]
    creator, error = _create(size, header, msg) if rank == 0 else (None, "")
    try:
        _exchange("sending the segment's name", group, timeout_s,
                  lambda: dist.broadcast(msg, global_ranks[0], group=group, async_op=True))
    except CommError:
        if creator is not None:  # nobody else can have it: remove it now, not at exit
            destroy(creator)
        raise
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
    mine = torch.tensor([0 if error else 1])
    try:
        _exchange("gathering who attached the segment", group, timeout_s,
                  lambda: dist.all_gather(statuses, mine, group=group, async_op=True))
    finally:
        # Everyone attached (or gave up, or the exchange failed): the name is no longer
        # needed. Every rank removes it, so on every rank it is gone when this returns
        # (rank 0 also tells its resource tracker, which would otherwise remove it at exit).
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
