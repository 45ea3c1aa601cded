"""The parameter-server strategies ``ps-sync``, ``ps-async`` and ``ps-ssp``: the workers' side.

A run with ``-n W --servers S`` has W + S ranks: workers on ranks 0..W−1 read the data and
train, servers on ranks W..W+S−1 hold the parameters and apply the config's optimizer
(:mod:`disttrain.parallel.parameter_server`). The workers run the shared loop with
:class:`WorkerRankStrategy`; a server's rank runs no loop and no strategy:
``train()`` hands it to :func:`disttrain.train.ps_server.serve_run`, which serves until every
worker is done and then meets the workers' ending, collective for collective::

    worker rank (the loop, W of them)              server rank (ps_server, S of them)
    build:  PSWorker: HELLO, pull every value      the same model; its shard of the keys
    step:   pull → forward/backward → push  ◄────► serve the pushes and pulls
    after its last step: DONE ─────────────────────► serving ends
    eval during training: pull, score the split    (nothing: no model until the end)
            (ps-sync: this worker's shard, summed
            over the workers' group; async, ssp:
            all of it, alone)
    ── every surviving rank, in this order ──────────────────────────────────────────
    finish: one all_reduce (the workers' last losses, their mean buffers) and S
            broadcasts (each server's final values): all hold the final model
    last evaluation: each scores 1/(W + S) of the split on the final model, summed
    end checkpoint, then the result's all-reduces (a server gives the workers' mean
            loss, so the average over every rank is the workers'), then the extras'

**A lost worker.** ``ps-async`` and ``ps-ssp`` (with staleness > 0) outlive a worker that
dies: the servers drop it and answer every DONE with the workers they lost, and the
survivors end the run on a group of their own (:func:`~disttrain.parallel.parameter_server.
reports.survivors`): the final evaluation, the result and the end checkpoint are theirs, the
first survivor (the lowest surviving worker) reports, and ``extras["lost_workers"]`` lists
the lost ranks. Its shard of each global batch is not trained on any more. That is why their
evaluations during training are each worker's own (no collective among workers that may be
gone); ``ps-sync`` stops at a dead worker.

``ps-sync`` averages the W gradients of a step before one update (exactly one process on
the global batch); ``ps-async`` applies each worker's gradient when it arrives, with the
learning rate divided by W (:func:`server_optimizer`); ``ps-ssp`` applies on arrival like
async but lets a worker run at most ``staleness`` steps ahead of the slowest (``--staleness
0`` is ps-sync exactly).

**Checkpoints** are written at the end of a run only (the servers serve from the start of
the run to its end, so ranks cannot meet mid-run): each server its shard, the first
surviving worker the mode, worker count and buffers. With ``resume`` the servers restore
before serving (:func:`resume_from`) and the workers resume at the clock the servers report.

**Samples/s.** In async mode workers step at their own pace, so the loop's figure (global
batch / rank 0's step time) would describe worker 0 only. ``extras["samples_per_s"]`` is
the sum over workers of (samples per step / that worker's mean step time): what the servers
ingest while every worker runs. With equal workers (sync) both figures are the same.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from disttrain.comm import Communicator
from disttrain.parallel import checkpoint_files
from disttrain.parallel.checkpoint_files import CheckpointError, atomic_save
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.parameter_server import (
    PSConfig,
    PSRoles,
    PSWorker,
    WorkerReport,
    assign_roles,
)
from disttrain.parallel.parameter_server.channel import TRAILER_BYTES
from disttrain.parallel.parameter_server.protocol import HEADER_FIELDS
from disttrain.parallel.parameter_server.reports import Survivors, finish, gather_extras, survivors
from disttrain.parallel.parameter_server.shard import checkpoint_path
from disttrain.train import checkpoint
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
    missing_state,
    optimizer_class,
    param_bytes,
)

MODES = {"ps-sync": "sync", "ps-async": "async", "ps-ssp": "ssp"}
DEFAULT_SERVERS = 1
HEADER_BYTES = HEADER_FIELDS * 8  # int64 fields
RUN_FILE = "ps-run.pt"  # a loop checkpoint's mode, worker count and the workers' buffers


def num_servers(config: TrainConfig) -> int:
    return config.parallel.servers or DEFAULT_SERVERS


def ps_config(config: TrainConfig) -> PSConfig:
    """The PSConfig every rank of a run builds (servers and workers must agree)."""
    opts = config.parallel
    staleness = PSConfig().staleness if opts.staleness is None else opts.staleness
    rule = PSConfig().staleness_lr if opts.staleness_lr is None else opts.staleness_lr
    return PSConfig(mode=MODES[config.strategy], staleness=staleness,
                    straggler=dict(opts.straggler), straggler_every=opts.straggler_every,
                    staleness_lr=rule)


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


def resume_from(config: TrainConfig, roles: PSRoles) -> str | None:
    """The checkpoint a server restores before it serves: the newest in ``checkpoint_dir``
    with ``resume``, None otherwise (the loop's own resume comes after serving). It must
    come from the same mode and number of workers: the saved optimizer keeps its learning
    rate, which is lr ÷ W where pushes apply on arrival."""
    if not config.resume or config.checkpoint_dir is None:
        return None
    path = checkpoint.latest(config.checkpoint_dir)
    if path is None:
        return None
    try:
        checkpoint_files.verify(path)  # the loop verifies again, after serving starts
    except CheckpointError as exc:
        raise CheckpointError(exc.problem, checkpoint.advice(config.checkpoint_dir,
                                                             os.path.basename(path))) from None
    files = [RUN_FILE] + [os.path.basename(checkpoint_path(path, s))
                          for s in range(roles.num_servers)]
    for name in files:
        if not os.path.exists(os.path.join(path, name)):
            raise missing_state(path, name)
    run = safe_load(os.path.join(path, RUN_FILE))
    if (run["mode"], run["workers"]) != (MODES[config.strategy], roles.num_workers):
        raise ValueError(f"checkpoint {path} was written by ps-{run['mode']} with "
                         f"{run['workers']} workers; resume it with --strategy "
                         f"ps-{run['mode']} -n {run['workers']}")
    return path


def build_parameter_server_strategy(ctx: BuildContext) -> Strategy:
    comm = ctx.require_comm(ctx.config.strategy)
    roles = assign_roles(comm.world_size, num_servers(ctx.config))
    steps = total_steps(ctx.config, roles.num_workers)
    role = roles.role(comm.rank)
    if role.kind == "server":
        raise ValueError(f"{role} serves parameters: its rank runs "
                         f"disttrain.train.ps_server.serve_run, not the training loop "
                         f"(train() calls it there)")
    return WorkerRankStrategy(ctx, comm, roles, steps)


def losable_ranks(config: TrainConfig, world_size: int) -> frozenset[int]:
    """The ranks whose death a run of ``config`` outlives: the workers in the modes whose
    servers drop a dead worker (async, ssp with staleness > 0), none otherwise."""
    if not ps_config(config).on_arrival:
        return frozenset()
    return frozenset(assign_roles(world_size, num_servers(config)).worker_ranks)


def score_over(team: Survivors, totals: torch.Tensor) -> torch.Tensor:
    """The final evaluation's totals ``(correct, count, loss_sum)`` summed over the ranks
    that finish the run, each of which scored one shard (workers and servers alike)."""
    if team.comm.world_size > 1:
        team.comm.all_reduce(totals)
    return totals


class WorkerRankStrategy(Strategy):
    """A worker: pull, forward/backward, push; the servers run the optimizer."""

    def __init__(self, ctx: BuildContext, comm: Communicator, roles: PSRoles,
                 steps: int) -> None:
        super().__init__(ctx.module, None, comm)
        self.roles, self.total_steps = roles, steps
        self.config = ps_config(ctx.config)  # PSWorker checks that stragglers are workers
        # ps-sync's evaluation totals during training (async and ssp workers score alone)
        self.group = None if self.config.on_arrival else comm.new_group(list(roles.worker_ranks))
        self.ps = PSWorker(comm, ctx.module, roles, self.config)
        self.team: Survivors | None = None  # the ranks that finish the run, once it is over
        self.samples_per_step = ctx.config.global_batch // roles.num_workers
        self.theory_bytes_per_step = float(param_bytes(ctx.module) + (
            2 * HEADER_BYTES + TRAILER_BYTES) * roles.num_servers)  # pull, push + its trailer
        self.report: WorkerReport | None = None
        self.start_step = 0  # the loop's first step: a resumed run starts at the checkpoint's
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
        if self.start_step + len(self._times) == self.total_steps and self.report is None:
            self._done()

    def _done(self) -> None:
        assert self.comm is not None
        self.report = self.ps.close()  # DONE: returns once every worker is done or lost
        self.team = survivors(self.comm, self.roles, self.report.lost_workers)
        finish(self.team, self.roles, self.ps.partition, self.module, self._last_loss, None)

    def save_state(self, path: str, rank: int) -> None:
        """The servers write the parameters and optimizer state (a file each); the loop
        writes this worker's sampler position and RNG. The first surviving worker (rank 0
        unless it was lost) adds the run's mode and worker count and the buffers (BatchNorm
        statistics, the workers' average after :func:`finish`), which no server holds."""
        assert self.comm is not None and self.team is not None  # saved after the last step
        if self.comm.rank == self.team.workers[0]:
            buffers = {k: v.detach() for k, v in self.module.named_buffers()}
            atomic_save({"mode": self.config.mode, "workers": self.roles.num_workers,
                         "buffers": buffers}, os.path.join(path, RUN_FILE))

    def load_state(self, path: str, rank: int) -> None:
        """The servers restored the checkpoint before serving and told this worker, in the
        HELLO reply, the clock to resume at: it must be the loop's step."""
        step = int(safe_load(os.path.join(path, "meta.pt"))["step"])
        if step != self.ps.clock:
            raise ValueError(f"checkpoint {path} is of step {step} but the servers resumed at "
                             f"clock {self.ps.clock}: they restored another checkpoint")
        run = os.path.join(path, RUN_FILE)
        if not os.path.exists(run):
            raise missing_state(path, RUN_FILE)
        self.module.load_state_dict(safe_load(run)["buffers"], strict=False)
        self.start_step = step
        if step >= self.total_steps:  # nothing left to train: release the servers now
            self._done()

    def _traffic(self) -> int:
        assert self.comm is not None
        return self.comm.stats.bytes_sent + self.comm.stats.bytes_recv

    def before_eval(self) -> None:
        if self.report is None:  # still training: read the servers' current values
            self.ps.pull_all(track=False)

    @property
    def eval_shards(self) -> int:
        if self.team is not None:  # the final model: every survivor scores a shard
            return self.team.comm.world_size
        return 1 if self.group is None else self.roles.num_workers

    @property
    def eval_shard(self) -> int:
        if self.team is not None:
            return self.team.comm.rank
        return 0 if self.group is None else self.dp_rank

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        if self.team is not None:
            return score_over(self.team, totals)
        if self.group is not None and self.roles.num_workers > 1:
            self.group.all_reduce(totals)
        return totals

    def result_comm(self) -> Communicator | None:
        return self.team.comm if self.team is not None else None

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
        assert self.team is not None  # the loop asks after the last step
        return gather_extras(self.team, self.roles, self.config,
                             [rate, self._wire / steps, dense, sleep, compute / steps, 0.0,
                              0.0, *step_s], {})

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.team is not None and self.team.own_comm:
            self.team.comm.close()
        self.team = None
