"""The ``torch`` transport: point-to-point messages over a torch.distributed process group.

Gloo moves CPU tensors over TCP; NCCL moves CUDA tensors. Each message is one
``ProcessGroup.send``/``recv`` (what ``dist.isend``/``irecv`` call); ``wait(timeout_s)``
maps Gloo's timeout and closed-connection errors onto the transport contract
(``TimeoutError`` / ``ConnectionError``).

Two torch.distributed pitfalls are handled here:

* ``dist.new_group(..., use_local_synchronization=True)`` names a group after its ranks and
  the number of groups the *calling process* already has; ranks with different histories
  (e.g. rank 1 in groups [0, 1] and [1, 2], rank 2 only in the second) compute different
  names and wait for each other forever. Members first agree on that count (padding with
  one-rank groups), so overlapping and nested groups work.
* When one rank dies, Gloo fails *every* pending transfer of its peers with the same error,
  so the peer a rank was waiting for is not necessarily the one that died.
  :meth:`TorchTransport.diagnose` asks the rendezvous store who is still there and looks
  at the processes of silent peers on this host (:mod:`disttrain.comm.checkin`).
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from disttrain.comm import watchdog
from disttrain.comm.checkin import Verdict, check_in
from disttrain.comm.errors import CommError
from disttrain.comm.liveness import DEAD, ProcessInfo, describe, local_state, read_table
from disttrain.comm.transport import PeerGoneError, PeerTimeoutError, RawWork, Transport
from disttrain.comm.transports import gloo_threads

_PEER_GONE = ("connection closed", "connection reset", "broken pipe", "closed by peer",
              "connection refused", "eof", "socket closed")
_SETUP_TAG = (1 << 30) + 1  # above every collective and user tag: group set-up messages
_SORT_RANKS = "sort_ranks" in inspect.signature(dist.new_group).parameters
_TABLE_READ_S = 5.0  # longest wait for the members' process table


def translate_error(exc: BaseException) -> BaseException:
    """Map a torch.distributed RuntimeError onto TimeoutError / ConnectionError when it is one."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text:
        return TimeoutError(str(exc))
    if any(marker in text for marker in _PEER_GONE):
        return ConnectionError(str(exc))
    return exc


def _reraise(exc: RuntimeError) -> NoReturn:
    """Raise ``exc`` as the transport contract's TimeoutError/ConnectionError when it is one
    (chained to the original), else unchanged."""
    translated = translate_error(exc)
    if translated is exc:
        raise exc
    raise translated from exc


def _post(start: Any, tensor: torch.Tensor, peer: int, tag: int, polls: bool) -> _TorchWork:
    """``start([tensor], peer, tag)``: a process group's send or recv, as dist.isend/irecv
    call it (complex tensors as real views)."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    try:
        return _TorchWork(start([tensor], peer, tag), polls)
    except RuntimeError as exc:
        _reraise(exc)


def _closed() -> CommError:
    return CommError("this transport was closed (Communicator.close or disttrain.shutdown); "
                     "create a new communicator")


def _naming(peer: int, call: Any, *args: Any) -> Any:
    """``call(*args)``; a TimeoutError/ConnectionError leaves as one that names ``peer``
    (the rank it concerns, read by ``Communicator.new_group`` to name it)."""
    try:
        return call(*args)
    except TimeoutError as exc:
        raise PeerTimeoutError(str(exc), peer) from exc
    except ConnectionError as exc:
        raise PeerGoneError(str(exc), peer) from exc


def job_store() -> Any:
    """The store the job met through (where ``disttrain.init()`` published each rank's
    process): torch hands out the default group's store under a prefix of its own."""
    store = dist.distributed_c10d._get_default_store()
    return getattr(store, "underlying_store", store)


class _ClosedGroup:
    """Stands in for the process group of a closed :class:`TorchTransport`, so that the
    group itself is released and any later use says why it fails."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and hasattr probes: no such attribute
            raise AttributeError(name)
        raise _closed()


class _TorchWork:
    """A process group's send or recv. Gloo's never reports ``is_completed()`` before
    someone called ``wait()`` on it (``polls`` False); NCCL's do."""

    def __init__(self, work: Any, polls: bool) -> None:
        self._work, self.polls = work, polls

    def wait(self, timeout_s: float) -> None:
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as exc:
            _reraise(exc)

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class TorchTransport(Transport):
    """Point-to-point over a torch.distributed process group (the default group if none).

    ``timeout_s`` bounds group creation and the set-up messages of :meth:`subgroup`."""

    name = "torch"

    def __init__(self, group: Any | None = None, timeout_s: float = 1800.0) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call disttrain.init() or "
                "torch.distributed.init_process_group() before creating a Communicator"
            )
        self._group: Any = group if group is not None else dist.group.WORLD
        self._global_ranks = tuple(dist.get_process_group_ranks(self._group))
        self._rank = dist.get_rank(self._group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process group")
        backend = str(dist.get_backend(self._group)).lower()
        self._device_type = "cuda" if "nccl" in backend else "cpu"
        self._bound = getattr(self._group, "bound_device_id", None) is not None
        self._paired: set[int] = set()  # NCCL: peers whose pair communicator exists
        self.timeout_s = timeout_s
        self._table: tuple[ProcessInfo | None, ...] | None = None
        self._table_read = False
        self._read_table()
        gloo_threads.tune_io_threads()  # Gloo's I/O threads must not spin on a busy core

    def _read_table(self) -> None:
        """Read the members' process table now, while the store surely answers: after a
        network partition it may not (then the table still tells this host's ranks from
        the others)."""
        try:
            self._processes(job_store())
        except Exception:  # no default store (or no table): diagnosed without one
            self._table_read = True

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
    def native_group(self) -> Any:
        if isinstance(self._group, _ClosedGroup):
            raise _closed()
        return self._group

    def close(self) -> None:
        """Release the process group: the transport keeps no reference to it, so
        ``destroy_process_group`` frees it now rather than at interpreter shutdown, where
        freeing a Gloo group can abort the process (seen with torch 2.13: "terminate called
        without an active exception" in about one run in eight). Messages are not waited
        for: the communicator has finished its queued work before it closes its transport."""
        self._group = _ClosedGroup()

    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def in_order(self) -> bool:
        """NCCL ignores tags and runs a pair's sends and receives in posting order."""
        return self._device_type == "cuda"

    @property
    def bound_to_device(self) -> bool:
        """The group was bound to a device (``init_process_group(device_id=...)``): NCCL runs
        all its point-to-point messages on the group's one communicator, in posting order."""
        return self._bound

    def connect(self, peers: Sequence[int]) -> None:
        """NCCL without a bound device creates a pair's communicator at its first message,
        blocking until the peer's first message to this rank (:mod:`disttrain.comm.
        nccl_rules`, rule 4): create the missing ones now, in ascending peer order (the
        order every rank shares, so no first contacts can cycle), one byte each, the lower
        rank sending. Nothing to do on Gloo (its pairs connect when the group is made)."""
        if self._device_type != "cuda" or self._bound:
            return
        for peer in sorted(set(peers) - self._paired - {self._rank}):
            token = torch.zeros(1, dtype=torch.uint8, device="cuda")
            post = self.isend if self._rank < peer else self.irecv
            _naming(peer, post(token, peer, _SETUP_TAG).wait, self.timeout_s)

    # The group's own send/recv take group ranks, as these methods do. dist.isend/irecv
    # would reach the same calls after argument handling that costs about as much again as
    # the call itself (29 against 15 µs to post a message here), on every message of every
    # algorithm. Gloo refuses to post on a connection that already broke: that error is
    # translated as a failed wait's is.
    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> RawWork:
        if self._device_type == "cuda":
            self._paired.add(dst)  # this call creates the pair's communicator, if missing
        return _post(self._group.send, tensor, dst, tag, self._device_type == "cuda")

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> RawWork:
        if self._device_type == "cuda":
            self._paired.add(src)
        return _post(self._group.recv, tensor, src, tag, self._device_type == "cuda")

    def tune_io(self, workload: str) -> None:
        gloo_threads.tune_io_threads(workload)  # docs/architecture.md: Gloo's I/O threads

    def subgroup(self, ranks: Sequence[int]) -> TorchTransport | None:
        """Members only: group rank i is ``ranks[i]`` (torch would sort them otherwise)."""
        if self._rank not in ranks:
            return None
        members = [self._global_ranks[r] for r in ranks]
        order: dict[str, Any] = {}
        if _SORT_RANKS:
            order["sort_ranks"] = False
        elif members != sorted(members):
            raise ValueError(f"this torch version orders group ranks by number; pass ranks in "
                             f"increasing order (got {list(ranks)}) or upgrade torch")
        self._agree_on_group_count(ranks)
        backend = "nccl" if self._device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=watchdog.group_timeout_s(backend, self.timeout_s))
        # Only members synchronise, so groups can be created by the ranks that need them.
        try:
            group = dist.new_group(members, timeout=timeout, use_local_synchronization=True,
                                   **order)
        except RuntimeError as exc:  # the members' store barrier: a timeout, or a lost peer
            _reraise(exc)
        return self._sibling(group)  # a subclass's rules hold in its groups

    def _sibling(self, group: Any) -> TorchTransport:
        """A transport like this one over ``group``."""
        return type(self)(group, self.timeout_s)

    def _agree_on_group_count(self, ranks: Sequence[int]) -> None:
        """Pad this process's process-group count to the members' maximum (see module doc)."""
        names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None)
        if names is None or len(ranks) == 1:
            return
        device = self._device_type  # NCCL moves CUDA tensors only
        mine = torch.tensor([len(names)], dtype=torch.int64, device=device)
        theirs = {r: torch.zeros(1, dtype=torch.int64, device=device)
                  for r in ranks if r != self._rank}
        pending = []
        for r, t in theirs.items():  # lower rank sends first: NCCL matches in posting order
            posts = [(self.isend, mine), (self.irecv, t)]
            pending += [(r, _naming(r, post, tensor, r, _SETUP_TAG))
                        for post, tensor in (posts if self._rank < r else posts[::-1])]
        for peer, work in pending:
            _naming(peer, work.wait, self.timeout_s)
        target = max(int(t) for t in [mine, *theirs.values()])
        me = self._global_ranks[self._rank]
        timeout = datetime.timedelta(seconds=self.timeout_s)
        while len(names) < target:  # a one-rank group needs no peer: it only takes a name
            dist.new_group([me], timeout=timeout, use_local_synchronization=True)

    def peer_died(self, peer: int) -> str | None:
        """How this host knows that group rank ``peer`` died (its process is gone), from
        the process table the members published; None when it does not know (alive, on
        another host, or no table). No store round trip: a local fact only."""
        table = self._table
        info = table[peer] if table is not None and 0 <= peer < len(table) else None
        state = local_state(info)
        return describe(state, info) if state == DEAD else None

    def unresponsive_ranks(self, grace_s: float) -> list[int] | None:
        """The group ranks to blame after a failure (see :meth:`diagnose`); None when the
        store cannot tell."""
        verdict = self.diagnose(grace_s)
        return None if verdict is None else list(verdict.missing)

    def diagnose(self, grace_s: float) -> Verdict | None:
        """After a broken connection or a timeout, check in through the rendezvous store
        and return who is to blame, with how each is known (:mod:`disttrain.comm.checkin`):
        a dead or stopped rank is named at once, a silent one after ``grace_s``.

        Gloo breaks every survivor's transfers at once when a rank dies, so survivors check
        in within milliseconds and the missing ranks are the dead ones. ``None`` when the
        store cannot tell (e.g. it lived in the dead rank on another host)."""
        try:
            store = job_store()
            prefix = f"disttrain/failure/{self._group.group_name}/"
            table = self._processes(store)
            return check_in(store, prefix, self._rank, self._global_ranks, table, grace_s)
        except Exception:  # a diagnosis aid: it must never mask the real error
            return None

    def _processes(self, store: Any) -> tuple[ProcessInfo | None, ...] | None:
        """The members' processes as they published them when they joined (read once,
        while the store answers; None when they did not publish, e.g. a file store set up
        by hand)."""
        if self._table is None and not self._table_read:
            self._table_read = True
            self._table = read_table(store, self._global_ranks, _TABLE_READ_S)
        return self._table
