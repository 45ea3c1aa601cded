"""The Communicator: every collective and point-to-point call, over any transport and algorithm.

Strategies talk only to a Communicator (never to torch.distributed), which

* validates arguments before anything moves (errors name the argument and the fix),
* picks an algorithm (explicit name, or ``auto`` by the α-β-γ cost model),
* runs it now or, with ``async_op=True``, on the progress thread in call order,
* counts bytes per collective, keeps a flight recorder, and turns any stuck wait into an
  error naming the op, its sequence number and the peer.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from disttrain.comm import algorithms, checks
from disttrain.comm.agreement import agreed_costs
from disttrain.comm.config import CommConfig
from disttrain.comm.context import (
    MAX_USER_TAG,
    CollectiveContext,
    ScratchArena,
    instance_tag_base,
)
from disttrain.comm.cost_model import LinkCosts, load_costs
from disttrain.comm.errors import CommError, PeerFailedError
from disttrain.comm.flight_recorder import FlightRecorder
from disttrain.comm.nccl_rules import NcclRulesTransport
from disttrain.comm.ops import ReduceOp, check_dtype, finish_
from disttrain.comm.p2p_work import P2PWork
from disttrain.comm.selection import AlgorithmChooser
from disttrain.comm.signature import signature_of, verify_signature
from disttrain.comm.staging import on_current_stream, staged
from disttrain.comm.stats import TrafficStats
from disttrain.comm.theory import theory_bytes_sent
from disttrain.comm.topology import Hierarchy, HierarchyConfig, build
from disttrain.comm.transport import Transport, check_workload
from disttrain.comm.transports.torch_p2p import TorchTransport
from disttrain.comm.work import ProgressThread, Work

log = logging.getLogger(__name__)


class Communicator:
    """Collectives among ``world_size`` ranks over a :class:`Transport`."""

    def __init__(self, transport: Transport, config: CommConfig | None = None,
                 costs: LinkCosts | None = None, *, owns_transport: bool = True) -> None:
        self.transport = transport
        # False when the transport is shared with another communicator: close() leaves it open
        self._owns_transport = owns_transport
        self.config = config or CommConfig()
        # ``auto`` must pick the same algorithm on every rank: all adopt rank 0's costs
        # (a calibration file may differ between machines, or be missing on some).
        self.costs = costs or agreed_costs(transport, load_costs(transport.name),
                                           self.config.timeout_s)
        self._chunk_bytes = self.config.chunk_bytes or self.costs.chunk_bytes
        self._algorithm = AlgorithmChooser(transport, self.config, self.costs)
        self.stats = TrafficStats()
        self.flight_recorder = FlightRecorder(self.config.flight_recorder_size)
        self._seq = 0
        self._p2p_seq = 0
        self._failure: BaseException | None = None
        self._peer_failures: dict[int, BaseException] = {}  # pairs a message broke on
        self._closed = False
        self._children: list[weakref.ref[Communicator]] = []  # from new_group, closed with it
        self._progress = ProgressThread(f"disttrain-comm-r{transport.rank}")
        self._tag_base = instance_tag_base(transport)  # own tags: communicators may share a group
        self._scratch = ScratchArena()  # the algorithms' landing buffers, reused call to call
        self._hierarchy: Hierarchy | None = None  # the ``hierarchical`` algorithm's groups
        self._hierarchy_for = self._built_hierarchy  # (bound once: handed to every context)

    @classmethod
    def from_torch(cls, group: Any | None = None, config: CommConfig | None = None) -> Communicator:
        """A communicator over an initialized torch.distributed group (default: WORLD)."""
        config = config or CommConfig()
        if config.nccl_rules:
            transport: TorchTransport = NcclRulesTransport(
                group, timeout_s=config.timeout_s, bound=config.nccl_rules == "bound")
        else:
            transport = TorchTransport(group, timeout_s=config.timeout_s)
        return cls(transport, config)

    # ----------------------------------------------------------------- identity
    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self.transport.global_ranks

    @property
    def device(self) -> torch.device:
        """Where this communicator's transport moves tensors: the CPU (Gloo, shared memory)
        or this rank's GPU (NCCL). Tensors elsewhere are staged (:mod:`.staging`)."""
        kind = self.transport.device_type
        return torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else (
            torch.device(kind))

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, "
                f"transport={self.transport.name!r})")

    # ----------------------------------------------------------------- machinery
    def _context(self, op: str, seq: int, algorithm: str) -> CollectiveContext:
        return CollectiveContext(
            self.transport, self.stats, op=op, seq=seq, algorithm=algorithm,
            timeout_s=self.config.timeout_s, chunk_bytes=self._chunk_bytes,
            tag_base=self._tag_base, on_progress=self._progress.beat, scratch=self._scratch,
            hierarchy=self._hierarchy_for,
        )

    def _check_usable(self, peers: Sequence[int] | None = None) -> None:
        """Raise if the communicator is closed or failed, or a message with one of ``peers``
        (None: every rank, as a collective involves them all) broke earlier."""
        if self._closed:
            raise CommError("this communicator was closed (Communicator.close or "
                            "disttrain.shutdown); create a new one to communicate again")
        if self._failure is not None:
            raise CommError(f"this communicator failed earlier and cannot be used again: "
                            f"{self._failure}") from self._failure
        broken = [p for p in (self._peer_failures if peers is None else peers)
                  if p in self._peer_failures]
        if broken:
            exc = self._peer_failures[broken[0]]
            raise CommError(f"this communicator failed earlier and cannot be used again with "
                            f"rank {broken[0]}: {exc}") from exc

    def _collective(self, op: str, algorithm: str | None, nbytes: int,
                    signature: Callable[[], Sequence[int]],
                    body: Callable[[CollectiveContext, str], None], async_op: bool,
                    choice_bytes: int | None = None) -> Work | None:
        """Run ``body`` as collective ``op``. ``auto`` picks by ``choice_bytes`` (default
        ``nbytes``), which must be the same on every rank or ranks pick different algorithms.
        ``signature()`` (what ranks must agree on) is computed only with debug checks."""
        self._check_usable()
        name = self._algorithm(op, algorithm, nbytes if choice_bytes is None else choice_bytes)
        self._seq += 1
        seq = self._seq
        record = self.flight_recorder.queued(seq, op, name, nbytes)
        self.stats.count_call(op)
        if name == "native":
            self.stats.count_unobserved(nbytes)

        def task() -> None:
            self.flight_recorder.started(record)
            try:
                self._check_usable()  # work queued behind a failure fails at once
                if self.config.debug_checks:
                    verify_signature(self._context("debug_check", seq, "naive"), op, seq,
                                     signature())
                ctx = self._context(op, seq, name)
                ctx.connect(algorithms.peers_to_connect(name, self.rank, self.world_size))
                body(ctx, name)
            except BaseException as exc:
                self.flight_recorder.ended(record, exc)
                if not isinstance(exc, (ValueError, TypeError)) and self._failure is None:
                    self._failure = exc
                raise
            self.flight_recorder.ended(record)

        fence = None
        if self.transport.device_type == "cuda":  # NCCL: follow the caller's stream
            task, fence = on_current_stream(task)
        return self._progress.run(task, async_op, self.config.timeout_s, op=op, seq=seq,
                                  name=name, fence=fence)

    def _tensor(self, name: str, tensor: Any) -> torch.Tensor:
        t = checks.tensor_arg(name, tensor, self.transport.device_type)
        return t.detach() if t.requires_grad else t

    def _root(self, root: Any) -> int:
        return checks.rank_arg("root", root, self.world_size)

    # ----------------------------------------------------------------- collectives
    @staged(inout=("tensor",))
    def all_reduce(self, tensor: torch.Tensor, op: str | ReduceOp = "sum", *,
                   algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over all ranks; every rank gets the result, in place."""
        t, rop = self._tensor("tensor", tensor), checks.reduce_op(op)
        check_dtype(t, rop)
        flat = checks.flat(t)
        return self._reducing("all_reduce", algorithm, checks.nbytes(t),
                              lambda: signature_of(t, rop), async_op, flat, flat, rop)

    @staged(inout=("tensor",))
    def broadcast(self, tensor: torch.Tensor, root: int = 0, *, algorithm: str | None = None,
                  async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from ``root`` to every rank, in place."""
        t, root = self._tensor("tensor", tensor), self._root(root)
        return self._plain("broadcast", algorithm, checks.nbytes(t),
                           lambda: signature_of(t, root=root), async_op, checks.flat(t), root)

    @staged(inout=("tensor",))
    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str | ReduceOp = "sum", *,
               algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Reduce onto ``root`` (in place there); other ranks' tensors are left unchanged."""
        t, root, rop = self._tensor("tensor", tensor), self._root(root), checks.reduce_op(op)
        check_dtype(t, rop)
        flat = checks.flat(t)
        is_root = self.rank == root  # elsewhere the algorithm may use a copy as scratch
        return self._reducing("reduce", algorithm, checks.nbytes(t),
                              lambda: signature_of(t, rop, root), async_op,
                              flat if is_root else None, flat if is_root else flat.clone(), root,
                              rop)

    @staged(out=("output",))
    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, *,
                   algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """``output`` = every rank's ``tensor`` concatenated in rank order (flat)."""
        out, t = self._blocks("output", output, "tensor", tensor, self.world_size, 1)
        return self._plain("all_gather", algorithm, checks.nbytes(out), lambda: signature_of(t),
                           async_op, checks.flat(out), checks.flat(t))

    @staged(out=("output",))
    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       op: str | ReduceOp = "sum", *, algorithm: str | None = None,
                       async_op: bool = False) -> Work | None:
        """``tensor`` is world_size blocks; rank r gets the reduction of every rank's block r."""
        rop = checks.reduce_op(op)
        out, t = self._blocks("output", output, "tensor", tensor, 1, self.world_size)
        check_dtype(t, rop)
        fo = checks.flat(out)
        return self._reducing("reduce_scatter", algorithm, checks.nbytes(t),
                              lambda: signature_of(t, rop), async_op, fo, fo, checks.flat(t), rop)

    @staged(inout=("output",))  # off the root an output passed in must keep its values
    def gather(self, output: torch.Tensor | None, tensor: torch.Tensor, root: int = 0, *,
               algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """On ``root``, ``output`` = every rank's ``tensor`` in rank order; elsewhere unused."""
        t, root = self._tensor("tensor", tensor), self._root(root)
        fo = None
        if self.rank == root:
            out = checks.root_buffer("output", output, root, "gather")
            fo = checks.flat(self._blocks("output", out, "tensor", t, self.world_size, 1)[0])
        return self._plain("gather", algorithm, checks.nbytes(t) * self.world_size,
                           lambda: signature_of(t, root=root), async_op, fo, checks.flat(t), root)

    @staged(out=("output",))
    def scatter(self, output: torch.Tensor, tensor: torch.Tensor | None, root: int = 0, *,
                algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """``tensor`` on ``root`` is world_size blocks; rank r receives block r in ``output``."""
        out, root = self._tensor("output", output), self._root(root)
        ft = None
        if self.rank == root:
            t = checks.root_buffer("tensor", tensor, root, "scatter")
            ft = checks.flat(self._blocks("output", out, "tensor", t, 1, self.world_size)[1])
        return self._plain("scatter", algorithm, checks.nbytes(out) * self.world_size,
                           lambda: signature_of(out, root=root), async_op, checks.flat(out), ft,
                           root)

    @staged(out=("output",))
    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor,
                   output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None, *,
                   algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Rank r sends rows ``input_split_sizes[j]`` of ``tensor`` (dim 0) to rank j and
        receives ``output_split_sizes[j]`` rows from rank j, like ``all_to_all_single``."""
        out, t = self._blocks("output", output, "tensor", tensor, 0, 0)
        out_rows, in_rows, row = checks.all_to_all_rows(out, t, output_split_sizes,
                                                        input_split_sizes, self.world_size)
        in_el, out_el = [r * row for r in in_rows], [r * row for r in out_rows]
        fo, ft = checks.flat(out), checks.flat(t)

        def body(ctx: CollectiveContext, name: str) -> None:
            fn = algorithms.get("all_to_all", name)
            if name == "native":
                fn(ctx, out, t, out_rows, in_rows)  # torch splits along dim 0, in rows
            else:
                fn(ctx, fo, ft, out_el, in_el)

        # Explicit splits may differ per rank: only the row size and dtype are common to all
        # ranks, so they are all that is compared and all that ``auto`` may choose by.
        uneven = input_split_sizes is not None or output_split_sizes is not None
        choice = row * t.element_size() if uneven else checks.nbytes(t)
        return self._collective("all_to_all", algorithm, checks.nbytes(t),
                                lambda: (row, *signature_of(t)[1:]), body, async_op,
                                choice_bytes=choice)

    def barrier(self, *, algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Return only when every rank has entered the barrier."""
        return self._plain("barrier", algorithm, 0, lambda: (0,), async_op)

    def _plain(self, op: str, algorithm: str | None, nbytes: int,
               signature: Callable[[], Sequence[int]], async_op: bool, *args: Any) -> Work | None:
        """A collective whose body is just the algorithm's call on ``args``."""

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get(op, name)(ctx, *args)

        return self._collective(op, algorithm, nbytes, signature, body, async_op)

    def _reducing(self, op: str, algorithm: str | None, nbytes: int,
                  signature: Callable[[], Sequence[int]], async_op: bool,
                  result: torch.Tensor | None, *args: Any) -> Work | None:
        """A reduction whose ``result`` (if any) gets the final step (``avg``: divide) after
        the algorithm's call on ``args`` (the reduce op last)."""
        rop, p = args[-1], self.world_size

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get(op, name)(ctx, *args)
            if result is not None:
                finish_(result, rop, p)

        return self._collective(op, algorithm, nbytes, signature, body, async_op)

    def _blocks(self, out_name: str, output: Any, in_name: str, tensor: Any, out_blocks: int,
                in_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked (output, tensor) of one dtype, ``output`` holding ``out_blocks`` /
        ``in_blocks`` times the elements of ``tensor`` (0, 0: any sizes)."""
        out, t = self._tensor(out_name, output), self._tensor(in_name, tensor)
        checks.blocks(out_name, out, in_name, t, out_blocks, in_blocks)
        return out, t

    # ----------------------------------------------------------------- point to point
    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, tag: int,
             check_in: bool = True, counted: int | None = None) -> P2PWork:
        self._check_usable(())
        t = self._tensor("tensor", tensor)
        peer, tag = checks.p2p_args(kind, peer, tag, self.world_size, self.rank, MAX_USER_TAG)
        self._check_usable((peer,))
        if self._p2p_seq == 0:  # a point-to-point workload: its I/O must not wait (auto)
            self.transport.tune_io("p2p")
        self._p2p_seq += 1
        # A message that cannot even be posted raises PeerFailedError here at once. Unlike a
        # failed wait it leaves the communicator usable: nothing was posted that could land
        # later, and a caller may still need to tell other ranks (a parameter server's
        # replies, a pipeline stage's failure notice).
        work = P2PWork.start(self.transport, self.stats, kind, checks.flat(t), peer, tag,
                             seq=self._p2p_seq, timeout_s=self.config.timeout_s,
                             on_error=functools.partial(self._fail_message, peer),
                             check_in=check_in, counted=counted)
        self.stats.count_call(kind)
        return work

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc

    def _fail_message(self, peer: int, exc: BaseException) -> None:
        """A point-to-point message failed. A broken connection poisons that pair only: a
        late message can come from that peer alone, so the others stay reachable (a
        parameter server outlives a dead worker). A timeout poisons the communicator: Gloo
        breaks every connection of a process whose wait expired."""
        if isinstance(exc, PeerFailedError):
            self._peer_failures.setdefault(peer, exc)
        else:
            self._fail(exc)

    @staged()
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0, *,
              check_in: bool = True) -> Work:
        """Start sending ``tensor`` to rank ``dst``; returns a handle with ``wait()``.
        ``check_in``: when the connection breaks, first wait (up to the grace period) for
        the other ranks to check in, to tell a dead ``dst`` from one that gave up; False
        names ``dst`` at once (a caller that only needs to know this peer is gone)."""
        return self._p2p("send", tensor, dst, tag, check_in)

    @staged(out=("tensor",))
    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0, *,
              check_in: bool = True, counted: int | None = None) -> Work:
        """Start receiving into ``tensor`` from rank ``src``; returns a handle with ``wait()``
        (``check_in`` as for :meth:`isend`). ``counted``: the bytes the message is expected
        to carry, counted as received instead of the buffer's size, where ``tensor`` is
        posted larger than the message to catch a longer one (:mod:`.overrun`)."""
        return self._p2p("recv", tensor, src, tag, check_in, counted)

    def connect(self, peers: Sequence[int]) -> None:
        """Create this rank's connections to ``peers`` now, in ascending rank order. NCCL
        (without ``device_id``) creates a pair's communicator at the pair's first message,
        and that call blocks until the peer's first message to this rank on the same group:
        point-to-point code whose first contacts could form a cycle (every rank first
        receiving from its left neighbour; two ranks meeting first on two groups in
        opposite orders) calls this first, on each group in one order every rank shares.
        Each peer must call it with this rank among its peers. Nothing happens on Gloo or
        shared memory; disttrain's collectives do it for themselves."""
        targets = [checks.rank_arg("peer", p, self.world_size) for p in peers]
        self._check_usable(targets)
        ctx = self._context("connect", self._p2p_seq, "p2p")
        try:
            ctx.connect(targets)
        except CommError as exc:
            self._fail(exc)
            raise

    def peer_died(self, peer: int) -> str | None:
        """How this host knows that rank ``peer`` died (``"died (pid 4711 on node3 is
        gone)"``), or None when it does not know. On NCCL a dead peer closes no connection
        (its messages just never complete), so code that outlives a lost peer asks this
        after a timeout, to tell a dead peer from a silent one."""
        probe = getattr(self.transport, "peer_died", None)
        return probe(peer) if probe is not None else None

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    # ----------------------------------------------------------------- theory
    def theory_bytes_sent(self, op: str, nbytes: int, algorithm: str | None = None
                          ) -> float | None:
        """Bytes the busiest rank sends in ``op`` of ``nbytes`` (the nccl-tests size) with
        the algorithm this communicator would run for ``algorithm`` (None: its default,
        ``auto``: its pick), by :func:`~disttrain.comm.theory.theory_bytes_sent`; None for
        ``native``, whose bytes torch.distributed does not show."""
        name = self._algorithm(op, algorithm, nbytes)
        return theory_bytes_sent(op, name, self.world_size, nbytes)

    # ----------------------------------------------------------------- memory
    def shared_zeros(self, shape: int | Sequence[int], dtype: torch.dtype = torch.float32, *,
                     only_if_useful: bool = False) -> torch.Tensor:
        """A zero-filled tensor that a large all-reduce reduces where it lies: on ``shm`` it
        lives in shared memory and algorithm ``shm`` (``auto`` there) reads the other ranks'
        copies instead of copying each into its slots (the role of NCCL's user-buffer
        registration); elsewhere an ordinary tensor. Collective: every rank calls it with
        the same shape and dtype, in the same order, and all-reduces the same slice of it
        (a mismatch raises on every rank). ``only_if_useful``: an ordinary tensor for a
        size the transport would not all-reduce in place. No room in /dev/shm raises
        ``ShmUnavailableError`` on every rank."""
        self._check_usable()
        dims = checks.shape_arg(shape)
        return self.transport.zeros(math.prod(dims), dtype, only_if_useful).view(dims)

    def expect_workload(self, workload: str) -> None:
        """Say what this process mostly does: ``"collectives"`` (DDP, ZeRO) or ``"p2p"``
        (``isend``/``irecv`` say it); the transport schedules its I/O threads for it."""
        self.transport.tune_io(check_workload(workload))

    # ----------------------------------------------------------------- hierarchy
    @property
    def hierarchy(self) -> Hierarchy | None:
        """The sub-communicators the ``hierarchical`` algorithm runs on (None before its
        first call or :meth:`build_hierarchy`); see :mod:`disttrain.comm.topology`."""
        return self._hierarchy

    def build_hierarchy(self, config: HierarchyConfig | None = None) -> Hierarchy:
        """Find the nodes and build the hierarchy now, replacing (closing) any earlier one.
        Collective; without it the first ``hierarchical`` call builds one with the default
        :class:`~disttrain.comm.topology.HierarchyConfig`."""
        self.close_hierarchy()
        self._hierarchy = build(self.transport, self.config.timeout_s,
                                config or HierarchyConfig(), self._sub_communicator)
        return self._hierarchy

    def close_hierarchy(self) -> None:
        """Close the hierarchy's sub-communicators (not collective; :meth:`close` does it
        too); the next ``hierarchical`` call builds a new one."""
        built, self._hierarchy = self._hierarchy, None
        if built is not None:
            built.close()

    def _built_hierarchy(self, ctx: CollectiveContext) -> Hierarchy:
        if self._hierarchy is None:  # built on the first call, naming it in errors
            self._hierarchy = build(self.transport, self.config.timeout_s, HierarchyConfig(),
                                    self._sub_communicator, ctx)
        return self._hierarchy

    def _sub_communicator(self, transport: Transport, algorithm: str) -> Communicator:
        """A hierarchy's leg: its own communicator, with this one's timeout."""
        return Communicator(transport, CommConfig(timeout_s=self.config.timeout_s,
                                                  algorithm=algorithm))

    # ----------------------------------------------------------------- groups, lifetime
    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """A sub-communicator over ``ranks`` (ranks of this communicator). Members must call it
        with the same list; non-members get ``None``. Rank i of the new communicator is
        ``ranks[i]`` here."""
        members = checks.group_ranks(ranks, self.world_size)
        self._check_usable(members)  # a group of ranks whose pairs all still work
        try:
            sub = self.transport.subgroup(members)
        except (TimeoutError, ConnectionError) as exc:
            raise self._group_failure(list(members), exc) from exc
        if sub is None:
            return None
        child = Communicator(sub, self.config, self.costs)
        self._children = [ref for ref in self._children if ref() is not None]
        self._children.append(weakref.ref(child))
        return child

    def _group_failure(self, members: list[int], exc: BaseException) -> CommError:
        """``new_group`` could not agree with the other members: named as a failed collective
        is (:meth:`CollectiveContext.failure`, check-in included), and this communicator is
        failed, since a late member's set-up message could still arrive."""
        peer = getattr(exc, "peer", None)  # the member whose exchange failed (torch_p2p)
        doing = (f"agreeing on group {members} with rank {peer}" if peer is not None else
                 f"creating group {members}")
        error = self._context("new_group", self._seq, "setup").failure(
            f"{doing} (every member must call new_group with these ranks)", exc, peer,
            timed_out=isinstance(exc, TimeoutError))
        self._fail(error)
        return error

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (the communicator holds no process group)."""
        return self._closed

    @property
    def failed(self) -> bool:
        """Whether a collective or message failed on this communicator (it is unusable,
        but for point-to-point messages and groups among the ranks whose pairs work)."""
        return self._failure is not None or bool(self._peer_failures)

    @property
    def unfinished(self) -> int:
        """Collectives queued or running on the progress threads of this communicator and
        of the sub-communicators made from it (0 when every asynchronous one completed)."""
        children = (ref() for ref in self._children)
        return self._progress.pending + sum(c.unfinished for c in children if c is not None)

    def close(self) -> None:
        """Finish queued work, stop the progress thread, close the sub-communicators made
        from this one (:meth:`new_group`, the ``hierarchical`` algorithm's), then the
        transport unless it was passed in with ``owns_transport=False`` (its owner closes
        it). A closed communicator raises :class:`CommError` when used and holds no process
        group, so ``torch.distributed.destroy_process_group()`` frees the group while the
        interpreter runs (freed at shutdown, it can abort the process: ``terminate called
        without an active exception``). Closing twice does nothing."""
        if self._closed:
            return
        self._progress.close(self.config.timeout_s)  # queued work may use the children
        for child in (ref() for ref in self._children):
            if child is not None:
                child.close()
        self._children.clear()
        self.close_hierarchy()
        self._scratch.clear()
        self._closed = True
        if self._owns_transport:
            self.transport.close()

