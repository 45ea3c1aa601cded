"""NCCL's rules for point-to-point messages, enforced on Gloo: a test mode of the torch transport.

A program that runs on Gloo can still hang or mix up its data on NCCL, because NCCL matches
messages differently. :class:`NcclRulesTransport` moves bytes over Gloo (CPU tensors, any
machine) but matches them as NCCL does, so the strategy suite fails on CPU, in CI, where it
would fail on a GPU cluster. Turn it on with ``CommConfig(nccl_rules=True)`` or
``DISTTRAIN_NCCL_RULES=1`` in the environment of every rank (``Communicator.from_torch``
then builds it instead of the plain ``torch`` transport). What it enforces, with what NCCL
does behind each rule (torch's ProcessGroupNCCL, torch 2.x):

1. **Tags are ignored.** NCCL has no tags (pytorch issue 125079): every message between two
   ranks of one communicator carries the same tag here, so they match in the order posted.
   Streams that must not mix need their own sub-communicator (``Communicator.new_group``,
   a process group and an NCCL communicator of their own) or an order both sides agree on.
2. **One queue per pair.** ProcessGroupNCCL runs every unbatched send and receive between
   two ranks on one CUDA stream of a two-rank NCCL communicator, each a kernel that waits
   for its match. Here each pair has a *lane*: its operations start one at a time, in
   posting order, each after the previous one matched and completed. A receive posted
   before a send to the same peer on both sides waits forever (then times out naming the
   operation), as it would on the GPUs; a pair that needs both directions at once must
   post them in an order both ranks agree on (``CollectiveContext.exchange``: the lower
   rank sends first).
3. **Completion is polled.** NCCL's works report ``is_completed()`` as soon as their kernel
   finished, without a ``wait()`` (Gloo's point-to-point works never do); here too
   (``polls = True``), so the code path that NCCL takes through
   :class:`~disttrain.comm.p2p_work.P2PWork` (no helper thread) is the one tested. The data
   of a receive is written when the lane reaches it, possibly long after the call: code
   that reads a receive buffer before its work completed reads stale bytes here.

4. **A pair's communicator is created at its first message.** Without ``device_id`` in
   ``init_process_group`` (disttrain never passes one), ProcessGroupNCCL creates a two-rank
   NCCL communicator per (group, pair) lazily, at the first send or receive between the
   two, and that call blocks until the peer makes its own first call to this rank on the
   same group. Here the first message to a peer on a transport blocks its posting call in
   the same way (a one-byte handshake with the peer on Gloo), and gives up after the
   timeout naming the peer. Ranks whose first contacts form a cycle (every rank first
   receiving from its left neighbour; two ranks first meeting on two groups in opposite
   orders) therefore hang here as on the GPUs. :meth:`Transport.connect` opens a set of
   pairs in an order that cannot cycle (ascending peer rank on every rank); the
   collectives and the pipeline call it before their first messages.
5. **A group bound to a device** (``init_process_group(device_id=...)``; every group made
   after it inherits the binding) uses its one main communicator for point-to-point too:
   every unbatched send and receive of the group, to any peer, runs on one stream in
   posting order, and no pair is created lazily. ``DISTTRAIN_NCCL_RULES=bound`` (or
   ``CommConfig(nccl_rules="bound")``) models such groups: one queue per group instead of
   one per pair. disttrain's own point-to-point collectives refuse bound groups
   (``native`` serves them; see ``Transport.bound_to_device``).
6. **A dead peer is silence.** Over NVLink or InfiniBand a peer that dies closes no
   connection a receiver would see: its messages never complete, and only a timeout ends
   the wait. Here a closed Gloo connection leaves the lane's messages pending in the same
   way; the communicator's timeout then names the peer, and the check-in says it died.

What it does not model: NCCL moves CUDA tensors only (the Communicator stages tensors on
another device, :mod:`disttrain.comm.staging`, so that difference is invisible to
strategies); NCCL does not check message sizes (a mismatch is undefined behaviour there;
Gloo raises here, so a size mismatch fails either way); collective (``native``) calls are
Gloo's own and unaffected; batched point-to-point (``batch_isend_irecv``) is not used by
disttrain.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from typing import Any

import torch

from disttrain.comm.transport import PairTimeoutError, RawWork
from disttrain.comm.transports.torch_p2p import TorchTransport, _naming

log = logging.getLogger(__name__)

ENV = "DISTTRAIN_NCCL_RULES"
_TAG = 0  # the one tag every message carries: NCCL has none
_HANDSHAKE_TAG = (1 << 30) + 2  # the pair-creation handshake: below the lanes, never mixed
_JOIN_S = 1.0  # how long close() waits for an idle lane to stop
_GROUP = -1  # the lane key of a group bound to a device: one queue for every peer


class _LaneWork:
    """One send or receive in a lane; completes when the lane ran it and its match came."""

    polls = True  # NCCL's works report completion without a wait()

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int) -> None:
        self.kind, self.tensor, self.peer = kind, tensor, peer
        self.done = threading.Event()
        self.error: BaseException | None = None

    def wait(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            way = "to" if self.kind == "send" else "from"
            raise TimeoutError(f"the {self.kind} {way} rank {self.peer} did not complete within "
                               f"{timeout_s:g}s under NCCL's rules (messages of a pair run one "
                               f"at a time in posting order, whatever their tags; see "
                               f"disttrain.comm.nccl_rules)")
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self.done.is_set()


class _Lane:
    """Sends and receives run one after the other in posting order, like the CUDA stream of
    an NCCL communicator: a pair's (lazily created) or, for a bound group, the group's."""

    def __init__(self, post: Callable[[str, torch.Tensor, int], RawWork], timeout_s: float,
                 name: str) -> None:
        self._post, self._timeout_s = post, timeout_s
        self._queue: SimpleQueue[_LaneWork | None] = SimpleQueue()
        self._broken: BaseException | None = None
        self._silenced: BaseException | None = None
        # a daemon: a lane stuck on a dead peer must not keep the process alive
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, work: _LaneWork) -> _LaneWork:
        self._queue.put(work)
        return work

    def stop(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while (work := self._queue.get()) is not None:
            if self._broken is not None:  # a broken pair fails everything after it, as
                work.error = self._broken  # Gloo's and NCCL's do
                work.done.set()
                continue
            try:  # longer than the caller's wait, whose error names the rule broken
                self._post(work.kind, work.tensor, work.peer).wait(2 * self._timeout_s + 1)
            except ConnectionError as exc:  # a dead peer: NCCL never says so (rule 6)
                self._silenced = exc
                log.debug("a peer's connection closed (%s): its messages never complete", exc)
                return  # this and every later message of the lane stay pending
            except BaseException as exc:  # TimeoutError by the contract
                work.error = self._broken = exc
            work.tensor = torch.empty(0)  # the lane keeps no message alive
            work.done.set()


class NcclRulesTransport(TorchTransport):
    """The ``torch`` transport over Gloo, matching messages by NCCL's rules (module doc).
    Same name and costs as the plain transport: ``auto`` chooses alike. ``bound``: model a
    group bound to a device (rule 5) instead of lazily created pairs (rule 4)."""

    def __init__(self, group: Any | None = None, timeout_s: float = 1800.0, *,
                 bound: bool = False) -> None:
        super().__init__(group, timeout_s)
        self._bound = bound
        self._lanes: dict[int, _Lane] = {}
        self._lanes_lock = threading.Lock()
        self._creating: dict[int, threading.Event] = {}  # pairs whose handshake runs now
        log.debug("rank %d: point-to-point under NCCL's rules (tags ignored, %s)", self.rank,
                  "one queue per group" if bound else "one lazily created queue per pair")

    @property
    def in_order(self) -> bool:
        return True

    @property
    def bound_to_device(self) -> bool:
        return self._bound

    def _sibling(self, group: Any) -> TorchTransport:
        return type(self)(group, self.timeout_s, bound=self._bound)

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> RawWork:
        return self._lane(dst).submit(_LaneWork("send", tensor, dst))

    def irecv(self, tensor: torch.Tensor, src: int, tag: int) -> RawWork:
        return self._lane(src).submit(_LaneWork("recv", tensor, src))

    def connect(self, peers: Sequence[int]) -> None:
        """Create the pairs with ``peers`` (ascending, one message each, lower rank
        sending), skipping those already made: the order every rank shares."""
        if self._bound:
            return
        for peer in sorted(set(peers) - {self.rank}):
            if peer in self._lanes:
                continue
            token = torch.zeros(1, dtype=torch.uint8)
            post = self.isend if self.rank < peer else self.irecv
            _naming(peer, post(token, peer, _TAG).wait, self.timeout_s)

    def _lane(self, peer: int) -> _Lane:
        key = _GROUP if self._bound else peer
        while True:
            lane = self._lanes.get(key)
            if lane is not None:
                return lane
            with self._lanes_lock:
                if key in self._lanes:
                    continue
                creating = self._creating.get(key)
                if creating is None:  # this thread creates the pair; others wait for it
                    creating = self._creating[key] = threading.Event()
                    break
            creating.wait(self.timeout_s)
        try:
            if not self._bound:
                self._handshake(peer)
            name = f"disttrain-nccl-rules-r{self.rank}-" + ("group" if self._bound else
                                                             f"p{peer}")
            lane = _Lane(self._start, self.timeout_s, name)
            with self._lanes_lock:
                self._lanes[key] = lane
            return lane
        finally:
            with self._lanes_lock:
                self._creating.pop(key).set()

    def _handshake(self, peer: int) -> None:
        """Block until ``peer`` makes its first call to this rank here too (rule 4)."""
        token, theirs = torch.ones(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
        sent = TorchTransport.isend(self, token, peer, _HANDSHAKE_TAG)
        try:
            TorchTransport.irecv(self, theirs, peer, _HANDSHAKE_TAG).wait(self.timeout_s)
            sent.wait(self.timeout_s)
        except TimeoutError as exc:
            raise PairTimeoutError(
                f"rank {peer} made no first call to this rank within {self.timeout_s:g}s on "
                f"this group: under NCCL's rules a pair's communicator is created at its "
                f"first message and that call blocks until the peer makes its own; first "
                f"contacts must come in one order all ranks share (Transport.connect), never "
                f"in a cycle ({exc})", peer) from exc

    def _start(self, kind: str, tensor: torch.Tensor, peer: int) -> RawWork:
        """Post one message on Gloo now, with the one tag (called by a lane)."""
        post = TorchTransport.isend if kind == "send" else TorchTransport.irecv
        return post(self, tensor, peer, _TAG)

    def close(self) -> None:
        with self._lanes_lock:
            lanes, self._lanes = list(self._lanes.values()), {}
        for lane in lanes:
            lane.stop()
        for lane in lanes:
            lane.thread.join(_JOIN_S)
        super().close()
