"""The server: holds a key range, applies the optimizer, answers W workers concurrently.

    workers ──PUSH/PULL/CLOCK──►  server s: keys [start, end)  ──REPLY──► workers
                                  ├─ ServerShard: values + optimizer state + pending grads
                                  └─ ClockTable: worker clocks; may this PULL proceed yet?

One conversation per worker runs on :func:`~.protocol.drive`: wait for the next request header,
validate it (:func:`~.protocol.decode_request`, then the key against the shard), GRANT and
receive the payload if it has one, act, REPLY (messaging: :class:`~.channel.ServerIO`). A PULL whose
clock is too far ahead for the consistency model waits inside its conversation (the others
go on) until the slowest worker's CLOCK lets it through. A bad request is logged and
answered with an error status; the conversation goes on. A worker that stays silent for
``timeout_s`` (no request, no heartbeat) is reported by role and rank, and the server
stops with that error, first telling the workers it holds (at a gate, or DONE) who failed.

**A dead worker** (its connection broke: the process died) ends only its conversation where
pushes apply on arrival (async, ssp with s > 0), as ps-lite promises: its clock leaves the
staleness bound, its pending gradients are dropped, a warning names it, and the others go
on. In clock-ordered modes (sync, ssp with s = 0) its share of the clock in progress is
mixed into the others', so the server stops, as for silence. At the end the servers swap
the workers each lost and answer every DONE with the union (:meth:`ParameterServer.serve`),
so every surviving rank knows the same survivors.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Generator
from typing import Any, NamedTuple

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server.channel import ServerIO
from disttrain.parallel.parameter_server.config import ClockTable, PSConfig, StalenessHistogram
from disttrain.parallel.parameter_server.partition import PSRoles, gather_flat, partition, specs_of
from disttrain.parallel.parameter_server.protocol import (
    END_CLOCK,
    Header,
    Msg,
    ProtocolError,
    PSError,
    PSPeerError,
    PSPeerFailedError,
    Status,
    Task,
    Wait,
    decode_request,
    drive,
    dtype_code,
    status_name,
)
from disttrain.parallel.parameter_server.reports import ServerReport
from disttrain.parallel.parameter_server.shard import (
    OptimizerFactory,
    ServerShard,
    UpdateKey,
    checkpoint_path,
    load_checkpoint,
    save_checkpoint,
)

log = logging.getLogger(__name__)
_NOTICE_S = 5.0  # how long a stopping server waits for the other workers' next request
Gen = Generator[Wait, None, Any]


class AppliedUpdate(NamedTuple):
    """One update a server applied (``ParameterServer.updates[v]`` made version v + 1): the
    worker that sent it (−1: a clock's average over every worker), its clock, and the
    version of this server's values each contributor had read: enough to replay a run."""

    worker: int
    clock: int
    read: tuple[int, ...]


def run_parameter_server(comm: Communicator, roles: PSRoles, model: nn.Module | Callable[[],
                         nn.Module], optimizer_factory: OptimizerFactory, config: PSConfig, *,
                         checkpoint_dir: str | None = None, restore_dir: str | None = None,
                         checkpoint_every: int = 0,
                         on_update: Callable[[int], None] | None = None) -> ServerReport:
    """Serve this rank's key range until every worker has sent DONE; returns the report.

    ``model`` (or a factory) gives the parameter shapes and this server's initial values;
    ``optimizer_factory(params)`` builds the optimizer for the shard (e.g. ``lambda p:
    torch.optim.SGD(p, lr=0.1, momentum=0.9)``). With ``restore_dir`` the shard starts from
    the checkpoint saved there; with ``checkpoint_dir`` it is saved there at the end and,
    if ``checkpoint_every`` > 0, every that many parameter versions. ``on_update(version)``
    is called after each applied update (progress, experiments)."""
    return build_parameter_server(comm, roles, model, optimizer_factory, config,
                                  checkpoint_dir=checkpoint_dir, restore_dir=restore_dir,
                                  checkpoint_every=checkpoint_every,
                                  on_update=on_update).serve()


def build_parameter_server(comm: Communicator, roles: PSRoles, model: nn.Module | Callable[[],
                           nn.Module], optimizer_factory: OptimizerFactory, config: PSConfig, *,
                           checkpoint_dir: str | None = None, restore_dir: str | None = None,
                           checkpoint_every: int = 0,
                           on_update: Callable[[int], None] | None = None,
                           record_updates: bool = False) -> ParameterServer:
    """:func:`run_parameter_server` without the serving: the server, ready to ``serve()``
    (afterwards ``server.shard.param`` holds this server's final values and, with
    ``record_updates``, ``server.updates`` every applied update in order)."""
    if comm.world_size != roles.world_size:
        raise ValueError(f"the communicator has {comm.world_size} ranks but the roles describe "
                         f"{roles.world_size} ({roles.num_servers} servers + "
                         f"{roles.num_workers} workers)")
    role = roles.role(comm.rank)
    if role.kind != "server":
        raise ValueError(f"rank {comm.rank} is {role}, not a server: call PSWorker there")
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) \
            or checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be an int ≥ 0, got {checkpoint_every!r}")
    module = model if isinstance(model, nn.Module) else model()
    part = partition(specs_of(module, config.sparse_params), roles.num_servers)
    start, end = part.server_range(role.index)
    params = [p for p in module.parameters() if p.requires_grad]
    values = gather_flat(params, part, start, end - start, params[0].dtype)
    shard = ServerShard(part, role.index, values, optimizer_factory, config.staleness_lr)
    server = ParameterServer(comm, roles, shard, config, checkpoint_dir=checkpoint_dir,
                             checkpoint_every=checkpoint_every, on_update=on_update,
                             record_updates=record_updates)
    if restore_dir is not None:
        server.restore(checkpoint_path(restore_dir, role.index))
    return server


class ParameterServer:
    """The request handlers and the per-worker conversations of one server."""

    def __init__(self, comm: Communicator, roles: PSRoles, shard: ServerShard, config: PSConfig,
                 *, checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 on_update: Callable[[int], None] | None = None,
                 record_updates: bool = False) -> None:
        self.comm, self.roles, self.shard, self.config = comm, roles, shard, config
        self.name = roles.describe(comm.rank)
        self.clocks = ClockTable(config.bound, roles.num_workers, on_arrival=config.on_arrival)
        self.staleness = StalenessHistogram()
        self.requests: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.fingerprint = config.fingerprint(shard.partition)
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.on_update = on_update
        self.io = ServerIO(comm, roles, config.resolve_timeout(comm.config.timeout_s),
                           lambda: self.shard.version, config.max_message_elems * 8)
        self._gated: dict[int, Header] = {}  # worker → its request waiting at the gate
        self._done: dict[int, Header] = {}  # worker → its DONE, answered at the end
        self._in_hand: dict[int, Header] = {}  # worker → its request being served, unanswered
        self.lost: dict[int, str] = {}  # lost worker rank → what happened
        self.updates: list[AppliedUpdate] | None = [] if record_updates else None

    def restore(self, path: str) -> None:
        clock = self.shard.load_state_dict(load_checkpoint(path))
        self.clocks = ClockTable(self.config.bound, self.roles.num_workers, start=clock,
                                 on_arrival=self.config.on_arrival)
        log.info("%s: restored version %d, clock %d from %s", self.name, self.shard.version,
                 clock, path)

    def save(self) -> str:
        assert self.checkpoint_dir is not None
        path = checkpoint_path(self.checkpoint_dir, self.shard.server)
        clock = self.clocks.slowest if self.config.on_arrival else self.clocks.applied
        save_checkpoint(path, self.shard.state_dict(clock))
        return path

    def serve(self) -> ServerReport:
        sent0, recv0 = self.comm.stats.bytes_sent, self.comm.stats.bytes_recv
        log.info("%s: keys [%d, %d) of %d, mode %s", self.name, self.shard.start,
                 self.shard.end, self.shard.partition.total, self.config.mode)
        tasks: list[Task] = [self._conversation(w) for w in range(self.roles.num_workers)]
        try:
            drive(tasks, self.io.watcher.wakeup)
            if len(self.lost) == self.roles.num_workers:
                raise PSError(f"{self.name}: every worker was lost ({self._lost_list()}); "
                              f"nothing is left to train")
            self._release(self._agree_on_losses())
        except PSError as exc:
            log.error("%s: stopping: %s", self.name, exc)
            self._abort(exc)
            raise
        finally:
            self.io.close()
        if self.checkpoint_dir is not None:
            self.save()
        log.info("%s: done at version %d; %s", self.name, self.shard.version, self.staleness)
        return ServerReport(self.shard.server, self.comm.rank, self.config.mode,
                            self.shard.version, self.clocks.slowest, self.staleness.as_dict(),
                            dict(self.requests), dict(self.rejected),
                            self.comm.stats.bytes_sent - sent0,
                            self.comm.stats.bytes_recv - recv0,
                            dict(self.lost))

    def _abort(self, exc: PSError) -> None:
        """Best effort: answer the requests held at a gate or in hand (a granted PUSH whose
        payload was awaited), the DONEs not answered yet and the next request of every
        other worker (if it comes within a few seconds) with PEER_FAILED (KEY: the failed
        rank), so those workers learn who failed instead of timing out on, or finding
        gone, this server."""
        failed = exc.rank if isinstance(exc, PSPeerError) and exc.rank is not None else -1
        rank_of = self.roles.worker_rank
        held = {**self._in_hand, **self._gated, **self._done}
        told = [rank_of(w) for w in held if rank_of(w) != failed]
        grace = min(self.io.timeout_s, _NOTICE_S)
        asking = [r for r in self.io.asking() if r != failed and r not in self.lost]
        try:
            for w, h in held.items():
                if rank_of(w) != failed:
                    self.io.reply(rank_of(w), h, status=Status.PEER_FAILED, key=failed)
            drive([*(_quietly(self.io.flush(rank)) for rank in told),
                   *(self.io.refuse_next(rank, failed, grace) for rank in asking)],
                  self.io.watcher.wakeup)
        except Exception as notice_error:  # the original error matters, not this one
            log.debug("%s: could not tell every worker: %s", self.name, notice_error)

    # ------------------------------------------------------------ the end of a run
    def _agree_on_losses(self) -> set[int]:
        """Swap the workers each server lost with every other server; all adopt the union
        (one server may have seen a worker's DONE before it died, another its death)."""
        workers = self.roles.num_workers
        mine = torch.zeros(workers, dtype=torch.int64)
        for rank in self.lost:
            mine[rank] = 1
        others = [r for r in self.roles.server_ranks if r != self.comm.rank]
        theirs = {r: torch.zeros(workers, dtype=torch.int64) for r in others}
        drive([self.io.exchange(r, mine, theirs[r]) for r in others], self.io.watcher.wakeup)
        for r, flags in theirs.items():
            for rank in flags.nonzero().reshape(-1).tolist():
                if rank not in self.lost:
                    self.lost[rank] = f"lost by {self.roles.describe(r)}"
                    log.warning("%s: %s was lost by %s; the run goes on without it",
                                self.name, self.roles.describe(rank), self.roles.describe(r))
        return set(self.lost)

    def _release(self, lost: set[int]) -> None:
        """Answer every surviving worker's DONE with the lost workers' flags. A worker that
        died after its DONE cannot be left out any more (the others already know the
        survivors): the failed flush stops the server, naming it."""
        flags = torch.tensor([int(r in lost) for r in self.roles.worker_ranks])
        rank_of = self.roles.worker_rank
        answered = []
        for w, h in list(self._done.items()):
            del self._done[w]
            if rank_of(w) not in lost:
                self.io.reply(rank_of(w), h, payload=flags)
                answered.append(rank_of(w))
        drive([self.io.flush(rank) for rank in answered], self.io.watcher.wakeup)

    def _lost_list(self) -> str:
        return ", ".join(self.roles.describe(r) for r in sorted(self.lost))

    # ------------------------------------------------------------ one worker's conversation
    def _conversation(self, w: int) -> Gen:
        """Serve worker ``w`` until its DONE; where the mode outlives a worker, its death
        (a broken connection) ends only this conversation."""
        rank = self.roles.worker_rank(w)
        try:
            yield from self._serve_worker(w, rank)
        except PSPeerFailedError as exc:
            if exc.rank != rank or not self.config.on_arrival:
                raise
            self._lose(w, rank, exc)

    def _lose(self, w: int, rank: int, exc: PSPeerFailedError) -> None:
        """Go on without worker ``w``: its clock leaves the bound (the gate opens for the
        others), its pending gradients and unsent answers are dropped."""
        clock = self.clocks.clocks[w]
        self.lost[rank] = f"at clock {clock}: {exc}"
        self.clocks.leave(w)  # applied on arrival: no clock completes here
        dropped = self.shard.discard(w)
        self.io.forget(rank)
        self._gated.pop(w, None)
        self._in_hand.pop(w, None)
        alive = self.roles.num_workers - len(self.lost)
        log.warning("%s: lost %s at clock %d (%s); %s mode goes on with %d worker(s): its "
                    "clock leaves the staleness bound, %d pending update(s) of it dropped",
                    self.name, self.roles.describe(rank), clock, exc, self.config.mode, alive,
                    dropped)

    def _serve_worker(self, w: int, rank: int) -> Gen:
        peer = self.roles.describe(rank)
        startup: float | None = self.config.startup_timeout(self.comm.config.timeout_s)
        while True:
            raw = yield from self.io.request(rank, startup)
            startup = None  # only the first request (HELLO) may take that long
            try:
                header = decode_request(raw, rank, self.config.max_message_elems)
                self.requests[Msg(header.type).name] += 1
                self._in_hand[w] = header
                if (yield from self._handle(w, rank, header)):
                    return
                del self._in_hand[w]  # answered: every reply is a handler's last step
            except ProtocolError as err:
                self._in_hand.pop(w, None)  # answered below
                self.rejected[status_name(err.status)] += 1
                log.error("%s: rejected a request from %s (%s): %s", self.name, peer,
                          status_name(err.status), err)
                self.io.reply(rank, Header.from_tensor(raw), status=err.status)

    def _handle(self, w: int, rank: int, h: Header) -> Generator[Wait, None, bool]:
        """Serve one validated request; True when the worker is done."""
        if h.type == Msg.HELLO:
            if h.key != self.fingerprint:
                raise ProtocolError(Status.CONFIG_MISMATCH, "the worker's model, number of "
                                    "servers, sparse_params or mode differ from the server's")
            self.io.reply(rank, h, clock=self.clocks.clocks[w])
        elif h.type in (Msg.PULL, Msg.PUSH):
            yield from self._dense(w, rank, h)
        elif h.type in (Msg.SPARSE_PULL, Msg.SPARSE_PUSH):
            yield from self._sparse(w, rank, h)
        elif h.type == Msg.CLOCK:
            self._check_clock(w, h)
            self._finish_clock(w, h)
            self.io.reply(rank, h)
        elif h.type == Msg.HEARTBEAT:
            self.io.reply(rank, h)
        else:  # DONE: answered once every worker is done or lost (_release)
            workers = self.roles.num_workers
            if h.count != workers:
                raise ProtocolError(Status.BAD_SIZE, f"DONE must count the {workers} workers "
                                    f"(one lost-flag each), not {h.count}")
            for clock in self.clocks.leave(w):
                self._apply((clock, -1))
            self._done[w] = h
            return True
        return False

    def _dense(self, w: int, rank: int, h: Header) -> Gen:
        where = self.shard.dense_slice(h.key, h.count)
        self._check_dtype(h)
        self._check_clock(w, h)
        if h.type == Msg.PULL:
            yield from self._gate(w, h)
            self.io.reply(rank, h, payload=self.shard.read_dense(where))
            return
        (grad,) = yield from self.io.payloads(rank, h, [(h.count, self.shard.dtype)])
        self.shard.add_dense(self._key(w, h.clock), where, grad)
        if h.extra & END_CLOCK:
            self._finish_clock(w, h)
        self.io.reply(rank, h)

    def _sparse(self, w: int, rank: int, h: Header) -> Gen:
        seg = self.shard.table(h.key)
        row = self.shard.partition.specs[seg.tensor].row_size
        if h.count > seg.row_end - seg.row_start:
            raise ProtocolError(Status.BAD_SIZE, f"{h.count} rows requested but server "
                                f"{self.shard.server} holds {seg.row_end - seg.row_start} rows "
                                f"of that table")
        if h.count * row > self.config.max_message_elems:
            raise ProtocolError(Status.TOO_LARGE, f"{h.count} rows of {row} elements exceed "
                                f"max_message_elems={self.config.max_message_elems}")
        self._check_dtype(h)
        self._check_clock(w, h)
        sizes = [(h.count, torch.int64)]
        if h.type == Msg.SPARSE_PUSH:
            sizes.append((h.count * row, self.shard.dtype))
        received = yield from self.io.payloads(rank, h, sizes)
        local = self.shard.check_rows(seg, received[0])  # after receiving: nothing left behind
        if h.type == Msg.SPARSE_PUSH:
            self.shard.add_rows(self._key(w, h.clock), seg, local, received[1])
            if h.extra & END_CLOCK:
                self._finish_clock(w, h)
            self.io.reply(rank, h)
            return
        yield from self._gate(w, h)
        self.io.reply(rank, h, payload=self.shard.read_rows(seg, local).view(-1),
                                 count=h.count)

    def _gate(self, w: int, h: Header) -> Gen:
        """Hold a read until every active worker finished clock ``h.clock − bound − 1``."""
        if not self.clocks.may_read(h.clock):
            self._gated[w] = h
            yield Wait(lambda: self.clocks.may_read(h.clock))
            del self._gated[w]

    # ------------------------------------------------------------ checks and updates
    def _check_dtype(self, h: Header) -> None:
        if h.dtype != dtype_code(self.shard.dtype):
            raise ProtocolError(Status.BAD_DTYPE, f"payload dtype code {h.dtype}, but the "
                                f"parameters are {self.shard.dtype}")

    def _check_clock(self, w: int, h: Header) -> None:
        if h.clock != self.clocks.clocks[w]:
            raise ProtocolError(Status.BAD_CLOCK, f"clock {h.clock}, but the server has the "
                                f"worker at clock {self.clocks.clocks[w]}")
        if (h.type == Msg.CLOCK or h.extra & END_CLOCK) and h.version > self.shard.version:
            raise ProtocolError(Status.BAD_CLOCK, f"version {h.version} was never served "
                                f"(the server is at version {self.shard.version})")

    def _key(self, w: int, clock: int) -> UpdateKey:
        return (clock, w) if self.config.on_arrival else (clock, -1)

    def _finish_clock(self, w: int, h: Header) -> None:
        key = self._key(w, h.clock)
        self.shard.contribute(key, h.version)
        completed = self.clocks.finish(w)
        if self.config.on_arrival:
            self._apply(key)
        for clock in completed:
            self._apply((clock, -1))

    def _apply(self, key: UpdateKey) -> None:
        before = self.shard.version
        stalenesses = self.shard.apply(key)
        for staleness in stalenesses:
            self.staleness.add(staleness)
        if self.updates is not None:
            self.updates.append(AppliedUpdate(key[1], key[0],
                                              tuple(before - s for s in stalenesses)))
        version = self.shard.version
        if self.checkpoint_dir is not None and self.checkpoint_every \
                and version % self.checkpoint_every == 0:
            self.save()
        if self.on_update is not None:
            self.on_update(version)


def _quietly(task: Gen) -> Gen:
    """``task``, its PSError swallowed: one worker that cannot be told stops no other."""
    try:
        yield from task
    except PSError:
        pass
