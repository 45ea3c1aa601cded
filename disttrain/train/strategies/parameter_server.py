"""The parameter-server strategies ``ps-sync``, ``ps-async`` and ``ps-ssp`` in the shared loop.

A run with ``-n W --servers S`` has W + S ranks: workers on ranks 0..W−1 read the data and
train, servers on ranks W..W+S−1 hold the parameters and apply the config's optimizer
(:mod:`disttrain.parallel.parameter_server`). Every rank runs the same loop; what it does
there depends on its role::

    worker rank (W of them)                       server rank (S of them)
    build:  PSWorker: HELLO, pull every value     build:  serve until every worker is DONE
    step:   pull → forward/backward → push                (the workers' steps happen here)
    after its last step: DONE ────────────────────────────► serving ends
    finish (every rank): one all_reduce (the workers' last losses, their mean buffers) and S
            broadcasts (each server's final values): every rank holds the final model
    eval:   pull, score this worker's shard, sum  steps and evaluations: no-ops on the
            over the workers' group               final model (nothing sent)
    result: the loop's all-reduces over all W + S ranks; a server's "loss" is the workers'
            mean, so the loop's average over ranks is the workers' average

``ps-sync`` averages the W gradients of a step before one update (exactly one process on
the global batch); ``ps-async`` applies each worker's gradient when it arrives, with the
learning rate divided by W (:func:`server_optimizer`); ``ps-ssp`` applies on arrival like
async but lets a worker run at most ``staleness`` steps ahead of the slowest (``--staleness
0`` is ps-sync exactly).

**Samples/s.** In async mode workers step at their own pace, so the loop's figure (global
batch / rank 0's step time) would describe worker 0 only. ``extras["samples_per_s"]`` is
the sum over workers of (samples per step / that worker's mean step time): what the servers
ingest while every worker runs. With equal workers (sync) both figures are the same.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.parameter_server import (
    Partition,
    PSConfig,
    PSRoles,
    PSWorker,
    ServerReport,
    WorkerReport,
    assign_roles,
    build_parameter_server,
)
from disttrain.parallel.parameter_server.flat import scatter_flat
from disttrain.parallel.parameter_server.protocol import HEADER_FIELDS
from disttrain.train.config import TrainConfig
from disttrain.train.data import build_dataset, size
from disttrain.train.sampler import DistributedSampler
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    OptimizerFactory,
    Strategy,
    optimizer_class,
    param_bytes,
)

MODES = {"ps-sync": "sync", "ps-async": "async", "ps-ssp": "ssp"}
DEFAULT_SERVERS = 1
HEADER_BYTES = HEADER_FIELDS * 8  # int64 fields


def num_servers(config: TrainConfig) -> int:
    return config.parallel.servers or DEFAULT_SERVERS


def ps_config(config: TrainConfig) -> PSConfig:
    """The PSConfig every rank of a run builds (servers and workers must agree)."""
    opts = config.parallel
    staleness = PSConfig().staleness if opts.staleness is None else opts.staleness
    return PSConfig(mode=MODES[config.strategy], staleness=staleness,
                    straggler=dict(opts.straggler))


def total_steps(config: TrainConfig, workers: int) -> int:
    """The loop's number of steps, computed as the loop will: a worker sends DONE after the
    last one, and a server must not start serving a run that cannot train."""
    per_step = config.micro_batch(workers) * config.accumulate
    if config.steps is not None:
        return config.steps
    shard = len(DistributedSampler(size(build_dataset(config.dataset, config.data).train),
                                   workers, 0, drop_last=True))
    if shard < per_step:
        raise ValueError(f"global batch {config.global_batch} is larger than the training "
                         f"split ({shard * workers} samples); use a smaller global_batch")
    return (config.epochs or 1) * (shard // per_step)


def server_optimizer(config: TrainConfig, workers: int) -> OptimizerFactory:
    """The config's optimizer for a server's shard. Where pushes are applied on arrival
    (async, ssp with staleness > 0) with learning rate lr/W: each update is one worker's
    gradient, 1/W of a global batch, so W of them add up to about one synchronous step (for
    SGD, momentum, weight decay and Adam alike) and ``--lr`` means the same in every mode."""
    cls, kwargs = optimizer_class(config)
    if ps_config(config).on_arrival:
        kwargs = {**kwargs, "lr": kwargs["lr"] / workers}

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        return cls(params, **kwargs)

    return make


def build_parameter_server_strategy(ctx: BuildContext) -> Strategy:
    comm = ctx.require_comm(ctx.config.strategy)
    roles = assign_roles(comm.world_size, num_servers(ctx.config))
    steps = total_steps(ctx.config, roles.num_workers)
    if roles.role(comm.rank).kind == "server":
        return ServerRankStrategy(ctx, comm, roles)
    return WorkerRankStrategy(ctx, comm, roles, steps)


def finish(comm: Communicator, roles: PSRoles, part: Partition, module: nn.Module,
           loss: float, own: torch.Tensor | None) -> float:
    """Every rank, once the servers stopped: returns the workers' mean last loss (workers
    give theirs, servers 0), writes each server's final values (``own`` on a server) into
    ``module``'s parameters, and gives every rank the workers' average of each buffer
    (BatchNorm statistics are kept by each worker; the servers hold parameters only)."""
    me = roles.role(comm.rank)
    buffers = list(module.buffers())
    mine = [b.detach().double().reshape(-1) for b in buffers] if me.kind == "worker" else [
        torch.zeros(b.numel(), dtype=torch.float64) for b in buffers]
    total = torch.cat([torch.tensor([loss], dtype=torch.float64), *mine])
    comm.all_reduce(total)
    total /= roles.num_workers
    at = 1
    with torch.no_grad():
        for b in buffers:
            mean = total[at:at + b.numel()].view_as(b)
            b.copy_(mean if b.is_floating_point() else mean.round())
            at += b.numel()
    params = [p for p in module.parameters() if p.requires_grad]
    for s, root in enumerate(roles.server_ranks):
        start, end = part.server_range(s)
        if end == start:
            continue
        if me.kind == "server" and me.index == s and own is not None:
            values = own.detach().clone()
        else:
            values = torch.empty(end - start, dtype=params[0].dtype)
        comm.broadcast(values, root=root)
        scatter_flat(params, part, start, values)
    return float(total[0])


class WorkerRankStrategy(Strategy):
    """A worker: pull, forward/backward, push; the servers run the optimizer."""

    def __init__(self, ctx: BuildContext, comm: Communicator, roles: PSRoles,
                 steps: int) -> None:
        super().__init__(ctx.module, None, comm)
        self.roles, self.total_steps = roles, steps
        self.config = ps_config(ctx.config)  # PSWorker checks that stragglers are workers
        self.group = comm.new_group(list(roles.worker_ranks))  # evaluation totals
        self.ps = PSWorker(comm, ctx.module, roles, self.config)
        self.samples_per_step = ctx.config.global_batch // roles.num_workers
        self.theory_bytes_per_step = float(param_bytes(ctx.module)
                                           + 2 * HEADER_BYTES * roles.num_servers)
        self.report: WorkerReport | None = None
        self._times: list[float] = []
        self._wire = 0  # bytes sent + received during steps
        self._last_loss = math.nan

    @property
    def dp_rank(self) -> int:
        return self.comm.rank if self.comm is not None else 0  # workers come first

    @property
    def dp_size(self) -> int:
        return self.roles.num_workers

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        assert self.comm is not None
        begin, wire = time.perf_counter(), self._traffic()
        with self.phase("pull"):
            self.ps.pull()  # waits here (sync, ssp) until the step may read
        self.module.zero_grad(set_to_none=True)
        loss = super().train_step(micro_batches, loss_fn, autocast)
        with self.phase("push"):
            self.ps.push()  # a straggler sleeps here first
        self._times.append(time.perf_counter() - begin)
        self._wire += self._traffic() - wire
        self._last_loss = float(loss)
        return loss

    def after_step(self) -> None:
        if len(self._times) == self.total_steps and self.report is None:
            assert self.comm is not None
            self.report = self.ps.close()  # DONE: the servers stop when all are done
            finish(self.comm, self.roles, self.ps.partition, self.module, self._last_loss, None)

    def _traffic(self) -> int:
        assert self.comm is not None
        return self.comm.stats.bytes_sent + self.comm.stats.bytes_recv

    def before_eval(self) -> None:
        if self.report is None:  # still training: read the servers' current values
            self.ps.pull_all(track=False)

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.roles.num_workers > 1:
            self.group.all_reduce(totals)
        return totals

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        assert self.comm is not None
        timed = self._times[warmup_steps:] or self._times
        rate = self.samples_per_step * len(timed) / sum(timed) if timed else 0.0
        steps = max(len(self._times), 1)
        dense = 2 * param_bytes(self.module)  # push and pull every value
        r = self.report
        sleep, compute = (r.straggler_sleep_s, r.compute_s) if r is not None else (0.0, 0.0)
        step_s = [0.0] * self.roles.num_workers  # this worker's slot: its mean step time
        step_s[self.dp_rank] = sum(timed) / len(timed) if timed else 0.0
        return gather_extras(self.comm, self.roles, self.config,
                             [rate, self._wire / steps, dense, sleep, compute / steps, 0.0,
                              0.0, *step_s], {})

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


class ServerRankStrategy(Strategy):
    """A server: serves the whole run while its strategy is built, then idles through the
    loop on the final model (the loop's steps and evaluations send nothing here)."""

    def __init__(self, ctx: BuildContext, comm: Communicator, roles: PSRoles) -> None:
        super().__init__(ctx.module, None, comm)
        self.roles, self.config = roles, ps_config(ctx.config)
        server = build_parameter_server(comm, roles, ctx.module,
                                        server_optimizer(ctx.config, roles.num_workers),
                                        self.config)
        self.report: ServerReport = server.serve()
        self.mean_loss = finish(comm, roles, server.shard.partition, ctx.module, 0.0,
                                server.shard.param)

    @property
    def dp_rank(self) -> int:
        return 0  # the loop's sampler needs a shard; a server reads it but trains nothing

    @property
    def dp_size(self) -> int:
        return self.roles.num_workers

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        return torch.tensor(self.mean_loss)

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        return totals  # the workers' evaluation is the run's; this one stays local

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        assert self.comm is not None
        r = self.report
        mine = [0.0] * 5 + [float(r.bytes_sent), float(r.bytes_recv)]
        return gather_extras(self.comm, self.roles, self.config,
                             mine + [0.0] * self.roles.num_workers, r.staleness)


def gather_extras(comm: Communicator, roles: PSRoles, config: PSConfig, mine: list[float],
                  staleness: dict[int, int]) -> dict[str, Any]:
    """Every rank: sum over all ranks (two all-reduces) the workers' rates, bytes, sleeps,
    compute and step times and the servers' traffic and staleness histograms. ``mine``:
    rate, wire bytes/step, dense bytes/step, straggler sleep, compute s/step, server bytes
    sent, received, then one mean step time per worker (zero but in this worker's slot)."""
    top = torch.tensor([max(staleness, default=-1)], dtype=torch.float64)
    comm.all_reduce(top, op="max")
    bins = [0.0] * (int(top) + 1)
    for k, n in staleness.items():
        bins[k] = float(n)
    sums = torch.tensor(mine + bins, dtype=torch.float64)
    comm.all_reduce(sums)
    w = roles.num_workers
    rate, wire, dense, sleep, compute, sent, recv, *rest = sums.tolist()
    step_s, hist = rest[:w], rest[w:]
    histogram = {k: int(n) for k, n in enumerate(hist) if n}
    updates = sum(histogram.values())
    return {"samples_per_s": rate, "mode": config.mode, "workers": w,
            "servers": roles.num_servers, "staleness_bound": config.bound,
            "worker_bytes_per_step": wire / w, "dense_bytes_per_step": dense / w,
            "straggler": {str(r): f for r, f in config.straggler.items()},
            "straggler_sleep_s": sleep, "server_bytes_sent": sent, "server_bytes_recv": recv,
            "compute_s_per_step": compute / w, "worker_step_s": step_s,
            "staleness": {str(k): n for k, n in histogram.items()},
            "staleness_mean": sum(k * n for k, n in histogram.items()) / updates
            if updates else 0.0, "staleness_max": max(histogram, default=0)}
