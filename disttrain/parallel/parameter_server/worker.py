"""PSWorker: a worker's handle on the servers, for any training loop.

    ps = PSWorker(comm, model, roles, config)      # HELLO, then pulls every parameter
    for inputs, targets in batches:
        ps.pull(sparse_ids=model.sparse_ids(inputs))  # fresh values (waits in sync/ssp)
        model.zero_grad()
        loss_fn(model(inputs), targets).backward()
        ps.push()                                   # gradients out, clock + 1
    report = ps.close()            # DONE; returns once every worker is done or lost

``pull`` writes into the model's parameters in place; ``push`` reads their ``.grad``. The
worker runs no optimizer: the servers do. Each call talks to all servers at once (one
conversation per server on :func:`~.protocol.drive`). Tables named in ``config.sparse_params``
move by rows: ``pull`` fetches the rows of ``sparse_ids`` (unique ids of the next batch;
a table not given there is pulled whole) and ``push`` sends the rows whose gradient is not
zero, as ``(ids, rows)``. Everything else moves as dense key ranges.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server.channel import Channel, Request
from disttrain.parallel.parameter_server.config import PSConfig
from disttrain.parallel.parameter_server.partition import (
    PSRoles,
    gather_flat,
    partition,
    scatter_flat,
    specs_of,
)
from disttrain.parallel.parameter_server.protocol import (
    END_CLOCK,
    Header,
    Msg,
    PSError,
    Watcher,
    drive,
    dtype_code,
)
from disttrain.parallel.parameter_server.reports import WorkerReport

log = logging.getLogger(__name__)


class PSWorker:
    """This rank's connection to every server of a parameter-server job."""

    def __init__(self, comm: Communicator, model: nn.Module, roles: PSRoles,
                 config: PSConfig) -> None:
        if comm.world_size != roles.world_size:
            raise ValueError(f"the communicator has {comm.world_size} ranks but the roles "
                             f"describe {roles.world_size}")
        self.role = roles.role(comm.rank)
        if self.role.kind != "worker":
            raise ValueError(f"rank {comm.rank} is {self.role}: run run_parameter_server there")
        unknown = sorted(set(config.straggler) - set(roles.worker_ranks))
        if unknown:
            raise ValueError(f"straggler ranks {unknown} are not workers; workers are ranks "
                             f"{roles.worker_ranks[0]}..{roles.worker_ranks[-1]}")
        self.comm, self.model, self.roles, self.config = comm, model, roles, config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.partition = partition(specs_of(model, config.sparse_params), roles.num_servers)
        self.dtype = self.params[0].dtype
        if any(p.dtype != self.dtype for p in self.params):
            raise ValueError("all trainable parameters must have one dtype (servers keep one "
                             "flat tensor); cast the model first, e.g. model.float()")
        timeout_s = config.resolve_timeout(comm.config.timeout_s)
        self.watcher = Watcher(f"ps-worker{self.role.index}")
        self.channels = [Channel(comm, self.watcher, r, roles.describe, timeout_s)
                         for r in roles.server_ranks]
        self.clock = 0
        self._read = [0] * roles.num_servers  # version each server's values were read at
        self._pulled: set[int] = set()  # servers read from since the last push
        self._steps = 0
        self._compute_s = self._comm_s = self._sleep_s = 0.0
        self._computing_since: float | None = None
        self._pull_s = self._push_s = 0.0  # this step's pull, the previous push (stragglers)
        self._slow_clocks: list[int] = []  # clocks this worker was slowed on
        self._bytes0 = (comm.stats.bytes_sent, comm.stats.bytes_recv)
        self._closed = False
        self._lost: tuple[int, ...] = ()  # workers the run went on without (from close())
        self._hello()
        self.pull_all()

    # ------------------------------------------------------------------ public API
    def pull(self, sparse_ids: Mapping[str, torch.Tensor] | None = None) -> None:
        """Fetch current values into the model: dense key ranges, and for sparse tables the
        rows in ``sparse_ids[name]`` (any shape, duplicates allowed) or the whole table."""
        sparse_ids = dict(sparse_ids or {})
        unknown = sorted(set(sparse_ids) - set(self.config.sparse_params))
        if unknown:
            raise ValueError(f"sparse_ids names {unknown} are not in config.sparse_params "
                             f"{list(self.config.sparse_params)}")
        unique = {}
        for name, ids in sparse_ids.items():
            t = self.partition.index(name)
            flat = torch.unique(ids.detach().reshape(-1).long())
            rows = self.partition.specs[t].rows
            if flat.numel() and (int(flat[0]) < 0 or int(flat[-1]) >= rows):
                raise ValueError(f"sparse_ids[{name!r}] has ids outside 0..{rows - 1}")
            unique[t] = flat
        plans = [self._pull_requests(s, unique) for s in range(self.roles.num_servers)]
        self._forget_overwritten(plans)
        begin = time.perf_counter()
        self._run(plans)
        self._computing_since = time.perf_counter()
        self._pull_s = self._computing_since - begin

    def pull_all(self, *, track: bool = True) -> None:
        """Fetch every parameter (each server's whole key range). ``track=False`` for a read
        outside a step (evaluation): it does not count as what the next push was computed
        from, so it cannot make that update look staler than it is."""
        plans = []
        for s in range(self.roles.num_servers):
            start, end = self.partition.server_range(s)
            plans.append([self._dense_pull(s, start, end - start, track)] if end > start else [])
        if track:
            self._forget_overwritten(plans)
        self._run(plans)

    def push(self, grads: Sequence[torch.Tensor | None] | None = None) -> None:
        """Send gradients (default: each trainable parameter's ``.grad``) and finish this
        clock. A straggler sleeps first, so that its step takes ``factor`` × its own work
        (see :meth:`_straggle`)."""
        self._straggle()
        grads = list(grads) if grads is not None else [p.grad for p in self.params]
        if len(grads) != len(self.params):
            raise ValueError(f"push got {len(grads)} gradients for {len(self.params)} "
                             f"trainable parameters")
        begin = time.perf_counter()
        self._run([self._push_requests(s, grads) for s in range(self.roles.num_servers)])
        self._push_s = time.perf_counter() - begin
        self.clock += 1
        self._steps += 1
        self._pulled.clear()

    def step(self, sparse_ids: Mapping[str, torch.Tensor] | None = None) -> None:
        """``push()`` this step's gradients, then ``pull(sparse_ids)`` for the next one."""
        self.push()
        self.pull(sparse_ids)

    def heartbeat(self) -> None:
        """Tell every server this worker is alive (call it in pauses near ``timeout_s``)."""
        self._run([[Request(Msg.HEARTBEAT)] for _ in self.channels])

    def close(self) -> WorkerReport:
        """Tell every server this worker is done and wait until every worker is done or
        lost (at most 90% of the communicator's timeout, as HELLO); returns the report,
        whose ``lost_workers`` every server agreed on. Idempotent."""
        if not self._closed:
            self._lost = self._done()
            self._closed = True
            self.watcher.close()
        sent, recv = self.comm.stats.bytes_sent, self.comm.stats.bytes_recv
        item = torch.empty((), dtype=self.dtype).element_size()
        return WorkerReport(self.role.index, self.comm.rank, self._steps,
                            sent - self._bytes0[0], recv - self._bytes0[1],
                            self._steps * 2 * self.partition.total * item, self._compute_s,
                            self._comm_s, self._sleep_s, tuple(self._slow_clocks), self._lost)

    def _done(self) -> tuple[int, ...]:
        """DONE to every server; each answers, once the run is over, which workers were
        lost (one flag per worker)."""
        workers = self.roles.num_workers
        answers: list[tuple[int, ...]] = []

        def note(h: Header, flags: torch.Tensor | None) -> None:
            assert flags is not None
            lost = tuple(flags.nonzero().reshape(-1).tolist())
            if self.comm.rank in lost:
                raise PSError(f"{self.role}: {self.roles.describe(h.sender)} dropped this "
                              f"worker (a connection of it broke); the run went on without it")
            answers.append(lost)

        self._run([[Request(Msg.DONE, count=workers, reply_elems=workers,
                            reply_dtype=torch.int64, on_reply=note)] for _ in self.channels],
                  timeout_s=self.config.startup_timeout(self.comm.config.timeout_s))
        if len(set(answers)) > 1:
            raise PSError(f"{self.role}: the servers disagree on the lost workers {answers}")
        if answers[0]:
            log.warning("%s: the run went on without %s", self.role,
                        ", ".join(self.roles.describe(r) for r in answers[0]))
        return answers[0]

    # ------------------------------------------------------------------ requests
    def _hello(self) -> None:
        fingerprint = self.config.fingerprint(self.partition)
        clocks: list[int] = []
        self._run([[Request(Msg.HELLO, key=fingerprint,
                            on_reply=lambda h, _: clocks.append(h.clock))]
                   for _ in self.channels],
                  timeout_s=self.config.startup_timeout(self.comm.config.timeout_s))
        if len(set(clocks)) > 1:
            raise PSError(f"servers resume at different clocks {clocks}: their checkpoints "
                          f"come from different runs")
        self.clock = clocks[0]

    def _dense_pull(self, s: int, offset: int, length: int, track: bool = True) -> Request:
        def store(h: Header, values: torch.Tensor | None) -> None:
            assert values is not None
            scatter_flat(self.params, self.partition, offset, values)
            if track:
                self._note_read(s, h)

        return Request(Msg.PULL, key=offset, count=length, dtype=dtype_code(self.dtype),
                       clock=self.clock, reply_elems=length, reply_dtype=self.dtype,
                       on_reply=store)

    def _pull_requests(self, s: int, unique: dict[int, torch.Tensor]) -> list[Request]:
        requests = [self._dense_pull(s, off, n) for off, n in self.partition.dense_pieces(s)]
        for seg in self.partition.segments(server=s):
            if not self.partition.specs[seg.tensor].sparse:
                continue
            if seg.tensor not in unique:
                requests.append(self._dense_pull(s, seg.start, seg.length))
                continue
            ids = _rows_in(unique[seg.tensor], seg.row_start, seg.row_end)
            if ids.numel():
                requests.append(self._sparse_pull(s, seg.tensor, ids))
        return requests

    def _sparse_pull(self, s: int, tensor: int, ids: torch.Tensor) -> Request:
        param = self.params[tensor]
        row = self.partition.specs[tensor].row_size

        def store(h: Header, values: torch.Tensor | None) -> None:
            assert values is not None
            with torch.no_grad():  # the reply lands where the transport moves bytes
                param.view(param.shape[0], row)[ids.to(param.device)] = values.view(
                    ids.numel(), row).to(param.device)
            self._note_read(s, h)

        return Request(Msg.SPARSE_PULL, key=tensor, count=ids.numel(),
                       dtype=dtype_code(self.dtype), clock=self.clock, payloads=[ids],
                       reply_elems=ids.numel() * row, reply_dtype=self.dtype, on_reply=store)

    def _push_requests(self, s: int, grads: list[torch.Tensor | None]) -> list[Request]:
        code, requests = dtype_code(self.dtype), []
        for offset, length in self.partition.dense_pieces(s):
            values = gather_flat(grads, self.partition, offset, length, self.dtype)
            requests.append(Request(Msg.PUSH, key=offset, count=length, dtype=code,
                                    clock=self.clock, payloads=[values]))
        for seg in self.partition.segments(server=s):
            if self.partition.specs[seg.tensor].sparse:
                ids, rows = _nonzero_rows(grads[seg.tensor], seg.row_start, seg.row_end,
                                          self.partition.specs[seg.tensor].row_size, self.dtype)
                if ids.numel():
                    requests.append(Request(Msg.SPARSE_PUSH, key=seg.tensor, count=ids.numel(),
                                            dtype=code, clock=self.clock, payloads=[ids, rows]))
        read = self._read[s] if s in self._pulled else self.channels[s].version
        if requests:  # the last push finishes the clock; otherwise a CLOCK request does
            requests[-1].extra, requests[-1].version = END_CLOCK, read
        else:
            requests.append(Request(Msg.CLOCK, clock=self.clock, version=read))
        return requests

    # ------------------------------------------------------------------ machinery
    def _forget_overwritten(self, plans: list[list[Request]]) -> None:
        """A server whose every key this pull reads (no table by rows) leaves no older value
        in the model: the versions read before no longer count for the next push."""
        for s, plan in enumerate(plans):
            if plan and all(r.type == Msg.PULL for r in plan):
                self._pulled.discard(s)

    def _note_read(self, s: int, h: Header) -> None:
        """Remember the oldest version this step's values from server ``s`` came from."""
        self._read[s] = h.version if s not in self._pulled else min(self._read[s], h.version)
        self._pulled.add(s)

    def _run(self, plans: list[list[Request]], timeout_s: float | None = None) -> None:
        if self._closed:
            raise PSError(f"{self.role}: this PSWorker is closed")
        begin = time.perf_counter()
        try:
            drive([ch.run(reqs, timeout_s) for ch, reqs in zip(self.channels, plans)],
                  self.watcher.wakeup)
        except PSError as exc:
            log.error("%s: %s", self.role, exc)
            raise
        finally:
            self._comm_s += time.perf_counter() - begin

    def _straggle(self) -> None:
        """A straggler's step takes ``factor`` × its own work: it sleeps (factor − 1) × (its
        compute since ``pull`` + that pull + its previous push), before pushing, so its
        gradients are as stale as a slow machine's and the sleep takes no CPU from others.
        The slowest worker's pulls never wait at a consistency gate (everyone waits for it),
        so for it they measure its own communication. A *rotating* slow-down
        (``straggler_every``) lands on workers that were fast a moment ago, whose pull may
        have waited at the gate for the previous slow worker; there the previous push,
        which never waits, stands for the pull too: (compute + 2 × previous push)."""
        if self._computing_since is None:
            return
        compute = time.perf_counter() - self._computing_since
        self._compute_s += compute
        self._computing_since = None
        factor = self.config.straggler_factor(self.comm.rank, self.clock,
                                              self.roles.num_workers)
        pull = self._pull_s if self.config.straggler_every is None else self._push_s
        extra = (factor - 1.0) * (compute + pull + self._push_s)
        if factor > 1.0:
            self._slow_clocks.append(self.clock)
        if extra > 0:
            time.sleep(extra)
            self._sleep_s += extra


def _rows_in(sorted_ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """The ids in ``[lo, hi)`` of an increasing id tensor."""
    a = int(torch.searchsorted(sorted_ids, lo))
    b = int(torch.searchsorted(sorted_ids, hi))
    return sorted_ids[a:b].contiguous()


def _nonzero_rows(grad: torch.Tensor | None, lo: int, hi: int, row: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[lo, hi)`` of a table's gradient that are not all zero: (ids, flat rows)."""
    if grad is None:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=dtype)
    if grad.is_sparse:
        grad = grad.coalesce().to_dense()
    part = grad.detach().reshape(grad.shape[0], row)[lo:hi]
    ids = part.ne(0).any(dim=1).nonzero().reshape(-1)
    return (ids + lo).contiguous(), part[ids].to(dtype).reshape(-1).contiguous()
