"""The Communicator: every collective and point-to-point call, over any transport and algorithm.

Strategies talk only to a Communicator (never to torch.distributed), which

* validates arguments before anything moves (errors name the argument and the fix),
* picks an algorithm (explicit name, or ``auto`` by the α-β-γ cost model),
* runs it now or, with ``async_op=True``, on the progress thread in call order,
* counts bytes per collective, keeps a flight recorder, and turns any stuck wait into an
  error naming the op, its sequence number and the peer.
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from disttrain.comm import algorithms, checks
from disttrain.comm.algorithms import shm as shm_algorithms
from disttrain.comm.algorithms import tree
from disttrain.comm.config import CommConfig
from disttrain.comm.context import COLLECTIVE_TAG_BASE, MAX_USER_TAG, CollectiveContext, Pending
from disttrain.comm.cost_model import (
    LinkCosts,
    choose,
    costs_from_bytes,
    costs_to_bytes,
    load_costs,
)
from disttrain.comm.errors import CommError
from disttrain.comm.flight_recorder import FlightRecorder
from disttrain.comm.ops import ReduceOp, check_dtype, finish_, parse_op
from disttrain.comm.signature import verify_signature
from disttrain.comm.stats import TrafficStats
from disttrain.comm.transport import Transport
from disttrain.comm.work import CollectiveWork, ProgressThread, Work

log = logging.getLogger(__name__)


class _P2PWork(Work):
    def __init__(self, ctx: CollectiveContext, pending: Pending,
                 on_error: Callable[[BaseException], None]) -> None:
        self._ctx, self._pending, self._done = ctx, pending, False
        self._on_error = on_error

    def wait(self, timeout: float | None = None) -> None:
        if not self._done:
            if timeout is not None:
                self._ctx.timeout_s = timeout
            try:
                self._ctx.wait(self._pending)
            except CommError as exc:  # the message may still arrive later: never reuse tags
                self._on_error(exc)
                raise
            self._done = True

    def is_completed(self) -> bool:
        return self._done or self._pending.raw.is_completed()


_instances: dict[int, int] = {}
_instances_lock = threading.Lock()


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
        self.costs = costs or _agreed_costs(transport, load_costs(transport.name),
                                            self.config.timeout_s)
        self.stats = TrafficStats()
        self.flight_recorder = FlightRecorder(self.config.flight_recorder_size)
        self._seq = 0
        self._p2p_seq = 0
        self._failure: BaseException | None = None
        self._progress = ProgressThread(f"disttrain-comm-r{transport.rank}")
        native = transport.native_group
        group_key = id(native) if native is not None else id(transport)
        with _instances_lock:  # two communicators on one group must not share tags
            index = _instances.get(group_key, 0)
            _instances[group_key] = index + 1
        self._tag_base = COLLECTIVE_TAG_BASE + (index % 64) * _INSTANCE_TAGS

    @classmethod
    def from_torch(cls, group: Any | None = None, config: CommConfig | None = None) -> Communicator:
        """A communicator over an initialized torch.distributed group (default: WORLD)."""
        from disttrain.comm.transports.torch_p2p import TorchTransport

        config = config or CommConfig()
        return cls(TorchTransport(group, timeout_s=config.timeout_s), config)

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

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, world_size={self.world_size}, "
                f"transport={self.transport.name!r})")

    # ----------------------------------------------------------------- machinery
    def _algorithm(self, op: str, algorithm: str | None, nbytes: int) -> str:
        """The algorithm to run: an explicit name always wins; the configured default applies
        where the collective has it (``CommConfig(algorithm="ring")`` still broadcasts);
        otherwise ``auto``: ``shm`` on the shared-memory transport, else the cost model."""
        runnable = [a for a in algorithms.names(op) if self._can_run(a)]
        name = algorithm
        if name is None:
            default = self.config.algorithm
            name = default if default in runnable else "auto"
        if name == "auto":
            if "shm" in runnable:
                return "shm"
            return choose(op, self.world_size, nbytes, self.costs, runnable)
        algorithms.get(op, name)  # raises a ValueError listing the choices
        if name not in runnable:
            raise ValueError(f"algorithm={name!r} cannot run on the {self.transport.name!r} "
                             f"transport; choose one of: {', '.join(['auto', *runnable])}")
        return name

    def _can_run(self, name: str) -> bool:
        if name == "native":
            return self.transport.native_group is not None
        if name == "shm":
            return shm_algorithms.supports(self.transport)
        return True

    def _context(self, op: str, seq: int, algorithm: str) -> CollectiveContext:
        return CollectiveContext(
            self.transport, self.stats, op=op, seq=seq, algorithm=algorithm,
            timeout_s=self.config.timeout_s,
            chunk_bytes=self.config.chunk_bytes or self.costs.chunk_bytes,
            tag_base=self._tag_base, on_progress=self._progress.beat,
        )

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise CommError(f"this communicator failed earlier and cannot be used again: "
                            f"{self._failure}") from self._failure

    def _collective(self, op: str, algorithm: str | None, nbytes: int, signature: Sequence[int],
                    body: Callable[[CollectiveContext, str], None], async_op: bool,
                    choice_bytes: int | None = None) -> Work | None:
        """Run ``body`` as collective ``op``. ``auto`` picks by ``choice_bytes`` (default
        ``nbytes``), which must be the same on every rank or ranks pick different algorithms."""
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
                                     signature)
                body(self._context(op, seq, name), name)
            except BaseException as exc:
                self.flight_recorder.ended(record, exc)
                if not isinstance(exc, (ValueError, TypeError)) and self._failure is None:
                    self._failure = exc
                raise
            self.flight_recorder.ended(record)

        if not async_op and self._progress.idle():
            task()
            return None
        description = f"{op} #{seq} ({name})"
        work = CollectiveWork(self._progress.submit(task, description), description,
                              self._progress, self.config.timeout_s, op=op, seq=seq)
        if async_op:
            return work
        work.wait()  # queued behind pending async work, so the order is kept
        return None

    def _tensor(self, name: str, tensor: Any) -> torch.Tensor:
        return checks.tensor_arg(name, tensor, self.transport.device_type).detach()

    def _root(self, root: Any) -> int:
        return checks.rank_arg("root", root, self.world_size)

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, tensor: torch.Tensor, op: str | ReduceOp = "sum", *,
                   algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over all ranks; every rank gets the result, in place."""
        t, rop = self._tensor("tensor", tensor), parse_op(op)
        check_dtype(t, rop)
        flat, p = t.view(-1), self.world_size

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("all_reduce", name)(ctx, flat, rop)
            finish_(flat, rop, p)

        return self._collective("all_reduce", algorithm, _nbytes(t), _sig(t, rop), body, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int = 0, *, algorithm: str | None = None,
                  async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from ``root`` to every rank, in place."""
        t, root = self._tensor("tensor", tensor), self._root(root)
        flat = t.view(-1)

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("broadcast", name)(ctx, flat, root)

        return self._collective("broadcast", algorithm, _nbytes(t), _sig(t, root=root), body,
                                async_op)

    def reduce(self, tensor: torch.Tensor, root: int = 0, op: str | ReduceOp = "sum", *,
               algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Reduce onto ``root`` (in place there); other ranks' tensors are left unchanged."""
        t, root, rop = self._tensor("tensor", tensor), self._root(root), parse_op(op)
        check_dtype(t, rop)
        flat, p, is_root = t.view(-1), self.world_size, self.rank == root

        def body(ctx: CollectiveContext, name: str) -> None:
            work = flat if is_root else flat.clone()  # algorithms may use it as scratch
            algorithms.get("reduce", name)(ctx, work, root, rop)
            if is_root:
                finish_(flat, rop, p)

        return self._collective("reduce", algorithm, _nbytes(t), _sig(t, rop, root), body,
                                async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, *,
                   algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """``output`` = every rank's ``tensor`` concatenated in rank order (flat)."""
        out, t = self._tensor("output", output), self._tensor("tensor", tensor)
        checks.same_dtype("output", out, "tensor", t)
        checks.numel_ratio("output", out, "tensor", t, self.world_size)
        fo, ft = out.view(-1), t.view(-1)

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("all_gather", name)(ctx, fo, ft)

        return self._collective("all_gather", algorithm, _nbytes(out), _sig(t), body, async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor,
                       op: str | ReduceOp = "sum", *, algorithm: str | None = None,
                       async_op: bool = False) -> Work | None:
        """``tensor`` is world_size blocks; rank r gets the reduction of every rank's block r."""
        out, t, rop = self._tensor("output", output), self._tensor("tensor", tensor), parse_op(op)
        checks.same_dtype("output", out, "tensor", t)
        checks.numel_ratio("tensor", t, "output", out, self.world_size)
        check_dtype(t, rop)
        fo, ft, p = out.view(-1), t.view(-1), self.world_size

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("reduce_scatter", name)(ctx, fo, ft, rop)
            finish_(fo, rop, p)

        return self._collective("reduce_scatter", algorithm, _nbytes(t), _sig(t, rop), body,
                                async_op)

    def gather(self, output: torch.Tensor | None, tensor: torch.Tensor, root: int = 0, *,
               algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """On ``root``, ``output`` = every rank's ``tensor`` in rank order; elsewhere unused."""
        t, root = self._tensor("tensor", tensor), self._root(root)
        fo = None
        if self.rank == root:
            if output is None:
                raise ValueError(f"output is required on the root (rank {root}) of gather")
            out = self._tensor("output", output)
            checks.same_dtype("output", out, "tensor", t)
            checks.numel_ratio("output", out, "tensor", t, self.world_size)
            fo = out.view(-1)
        ft = t.view(-1)

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("gather", name)(ctx, fo, ft, root)

        return self._collective("gather", algorithm, _nbytes(t) * self.world_size,
                                _sig(t, root=root), body, async_op)

    def scatter(self, output: torch.Tensor, tensor: torch.Tensor | None, root: int = 0, *,
                algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """``tensor`` on ``root`` is world_size blocks; rank r receives block r in ``output``."""
        out, root = self._tensor("output", output), self._root(root)
        ft = None
        if self.rank == root:
            if tensor is None:
                raise ValueError(f"tensor is required on the root (rank {root}) of scatter")
            t = self._tensor("tensor", tensor)
            checks.same_dtype("output", out, "tensor", t)
            checks.numel_ratio("tensor", t, "output", out, self.world_size)
            ft = t.view(-1)
        fo = out.view(-1)

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("scatter", name)(ctx, fo, ft, root)

        return self._collective("scatter", algorithm, _nbytes(out) * self.world_size,
                                _sig(out, root=root), body, async_op)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor,
                   output_split_sizes: list[int] | None = None,
                   input_split_sizes: list[int] | None = None, *,
                   algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Rank r sends rows ``input_split_sizes[j]`` of ``tensor`` (dim 0) to rank j and
        receives ``output_split_sizes[j]`` rows from rank j, like ``all_to_all_single``."""
        out, t = self._tensor("output", output), self._tensor("tensor", tensor)
        checks.same_dtype("output", out, "tensor", t)
        if out.shape[1:] != t.shape[1:]:
            raise ValueError(f"output rows have shape {tuple(out.shape[1:])} but tensor rows "
                             f"have {tuple(t.shape[1:])}; they must match")
        p = self.world_size
        in_rows = checks.splits_arg("input_split_sizes", input_split_sizes,
                                    t.shape[0] if t.dim() else 1, p)
        out_rows = checks.splits_arg("output_split_sizes", output_split_sizes,
                                     out.shape[0] if out.dim() else 1, p)
        row = _row_elems(t)
        in_el, out_el = [r * row for r in in_rows], [r * row for r in out_rows]
        fo, ft = out.view(-1), t.view(-1)

        def body(ctx: CollectiveContext, name: str) -> None:
            fn = algorithms.get("all_to_all", name)
            if name == "native":
                fn(ctx, out, t, out_rows, in_rows)  # torch splits along dim 0, in rows
            else:
                fn(ctx, fo, ft, out_el, in_el)

        # Explicit splits may differ per rank: only the row size and dtype are common to all
        # ranks, so they are all that is compared and all that ``auto`` may choose by.
        uneven = input_split_sizes is not None or output_split_sizes is not None
        choice = row * t.element_size() if uneven else _nbytes(t)
        return self._collective("all_to_all", algorithm, _nbytes(t), (row, *_sig(t)[1:]), body,
                                async_op, choice_bytes=choice)

    def barrier(self, *, algorithm: str | None = None, async_op: bool = False) -> Work | None:
        """Return only when every rank has entered the barrier."""

        def body(ctx: CollectiveContext, name: str) -> None:
            algorithms.get("barrier", name)(ctx)

        return self._collective("barrier", algorithm, 0, (0,), body, async_op)

    # ----------------------------------------------------------------- point to point
    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, tag: int) -> _P2PWork:
        self._check_usable()
        t = self._tensor("tensor", tensor)
        name = "dst" if kind == "send" else "src"
        peer = checks.rank_arg(name, peer, self.world_size, self_rank=self.rank)
        if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_USER_TAG:
            raise ValueError(f"tag must be an int in 0..{MAX_USER_TAG}, got {tag!r}")
        self._p2p_seq += 1
        ctx = CollectiveContext(self.transport, self.stats, op=kind, seq=self._p2p_seq,
                                algorithm="p2p", timeout_s=self.config.timeout_s,
                                chunk_bytes=1, tag_base=tag)
        flat = t.view(-1)
        pending = ctx.isend(flat, peer) if kind == "send" else ctx.irecv(flat, peer)
        self.stats.count_call(kind)
        return _P2PWork(ctx, pending, self._fail)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to rank ``dst``; returns a handle with ``wait()``."""
        return self._p2p("send", tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Work:
        """Start receiving into ``tensor`` from rank ``src``; returns a handle with ``wait()``."""
        return self._p2p("recv", tensor, src, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.isend(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.irecv(tensor, src, tag).wait()

    # ----------------------------------------------------------------- groups, lifetime
    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """A sub-communicator over ``ranks`` (ranks of this communicator). Members must call it
        with the same list; non-members get ``None``. Rank i of the new communicator is
        ``ranks[i]`` here."""
        self._check_usable()
        ranks = list(ranks)
        if not ranks:
            raise ValueError("new_group needs at least one rank")
        for i, r in enumerate(ranks):
            checks.rank_arg(f"ranks[{i}]", r, self.world_size)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group ranks contain duplicates: {ranks}; list each rank once")
        sub = self.transport.subgroup(ranks)
        return None if sub is None else Communicator(sub, self.config, self.costs)

    def close(self) -> None:
        """Finish queued work, stop the progress thread, and close the transport unless it
        was passed in with ``owns_transport=False`` (shared with another communicator)."""
        self._progress.close(self.config.timeout_s)
        if self._owns_transport:
            self.transport.close()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _row_elems(t: torch.Tensor) -> int:
    """Elements per row along dim 0 (a 0-d tensor is one row of one element)."""
    return 1 if t.dim() == 0 else math.prod(t.shape[1:])


def _sig(t: torch.Tensor, op: ReduceOp | None = None, root: int = -1) -> tuple[int, ...]:
    """What every rank must agree on for a collective: size, dtype, reduce op, root."""
    dtype_code = zlib.crc32(str(t.dtype).encode())
    op_code = -1 if op is None else list(ReduceOp).index(op)
    return (t.numel(), dtype_code, op_code, root)


_MAX_COSTS_BYTES = 1 << 20
_INSTANCE_TAGS = 1 << 13  # tags per communicator instance on one group
_AGREE_TAG = COLLECTIVE_TAG_BASE + 64 * _INSTANCE_TAGS  # past every instance's range


def _agreed_costs(transport: Transport, local: LinkCosts, timeout_s: float) -> LinkCosts:
    """Rank 0's costs on every rank: a binomial-tree broadcast of their JSON encoding
    (length first), counted apart from the communicator's own traffic."""
    if transport.world_size == 1:
        return local
    ctx = CollectiveContext(transport, TrafficStats(), op="agree_costs", seq=0,
                            algorithm="tree", timeout_s=timeout_s, chunk_bytes=1 << 20,
                            tag_base=_AGREE_TAG)
    payload = costs_to_bytes(local) if transport.rank == 0 else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    tree.broadcast(ctx, length, 0)
    size = int(length.item())
    if not 0 < size <= _MAX_COSTS_BYTES:
        raise CommError(f"rank 0 announced {size} bytes of cost-model data; expected "
                        f"1..{_MAX_COSTS_BYTES} (are all ranks running the same disttrain?)")
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if transport.rank == 0
           else torch.empty(size, dtype=torch.uint8))
    tree.broadcast(ctx, buf, 0)
    return local if transport.rank == 0 else costs_from_bytes(bytes(buf.tolist()))

