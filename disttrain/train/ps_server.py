"""A parameter server's rank in a ``ps-*`` run: :func:`serve_run`, which ``train()`` calls on
the last ``--servers`` ranks instead of the training loop.

The workers (ranks 0..W−1) run the shared loop with
:class:`~disttrain.train.strategies.parameter_server.WorkerRankStrategy`. A server has no
steps: it answers the workers' pushes and pulls until each has sent DONE, then ends the run
with the surviving workers, meeting each collective of their loop's ending in the same
order (a rank that skipped one, or took two in another order, would leave the others
waiting)::

    server rank (this module)                     worker rank (the loop)
    the model, built as the loop builds it;       the model; HELLO, pull every value
    its shard of the keys (--resume: restored)
    serve ◄───────── PUSH / PULL / CLOCK ──────── steps 1..T; DONE after the last
    ── every survivor, in this order ─────────────────────────────────────────────────
    finish: one all_reduce (the workers' last losses, their mean buffers), then S
            broadcasts (each server's final values): every rank holds the final model
    final evaluation: each survivor scores 1/(W' + S) of the held-out split; all_reduce
    end checkpoint (--checkpoint-dir): a server writes its shard; the seal's barriers
    result: all_reduce of the last losses (a server gives the workers' mean, so the
            average over every survivor is theirs); all_reduce(max) of the measurements
    extras: all_reduce(max) of the staleness, all_reduce of the sums (servers: traffic)

W' counts the workers that finish (``ps-async`` and ``ps-ssp`` outlive a dead one: the
survivors then meet on a group of their own, :func:`~disttrain.parallel.parameter_server.
reports.survivors`). The result is a :class:`~disttrain.train.result.TrainResult` like a
worker's for everything gathered (final loss, accuracy, the maxima, ``extras``); what is
per step is empty, since a server takes none: no step times, losses or rates, and its
traffic is ``extras["server_bytes_sent"]`` and ``["server_bytes_recv"]``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.parameter_server import (
    ParameterServer,
    ServerReport,
    assign_roles,
    build_parameter_server,
)
from disttrain.parallel.parameter_server.reports import Survivors, finish, gather_extras, survivors
from disttrain.parallel.parameter_server.shard import checkpoint_path
from disttrain.train import checkpoint
from disttrain.train.config import TrainConfig
from disttrain.train.data import build_dataset, size
from disttrain.train.device import resolve_device
from disttrain.train.evaluate import evaluate
from disttrain.train.flops import throughput_of
from disttrain.train.memory import measure_state, optimizer_tensors
from disttrain.train.metrics import peak_memory_bytes
from disttrain.train.models import build_model
from disttrain.train.precision import autocast_factory
from disttrain.train.result import EvalPoint, TrainResult
from disttrain.train.sampler import DistributedSampler
from disttrain.train.strategies import LossFn, get_strategy
from disttrain.train.strategies.base import PhaseRecorder
from disttrain.train.strategies.parameter_server import (
    num_servers,
    ps_config,
    resume_from,
    score_over,
    server_optimizer,
)

__all__ = ["ServerRun", "serve_run", "serves_parameters"]


def serves_parameters(config: TrainConfig, comm: Communicator) -> bool:
    """Is this rank one of a parameter-server run's servers (the last ``--servers``)?"""
    return (get_strategy(config.strategy).layout == "ps"
            and comm.rank >= comm.world_size - num_servers(config))


def serve_run(config: TrainConfig, comm: Communicator, micro: int, loss_fn: LossFn,
              phases: PhaseRecorder | None = None) -> TrainResult:
    """Serve this rank's keys for the whole run of ``config``, end it with the workers and
    return this rank's result. ``micro``: the workers' micro-batch (the loop's checked
    setup), ``loss_fn``: the loop's evaluation loss; ``phases`` (a timeline) receives the
    communicator, whose flight recorder holds this rank's traffic."""
    if phases is not None:
        phases.communicators = [comm]
    run = ServerRun(config, comm, micro)
    try:
        return run.execute(loss_fn)
    finally:
        run.close()


class FinalModel:
    """What :func:`~disttrain.train.evaluate.evaluate` scores on a server: the final model,
    one shard of the held-out split per surviving rank, the totals summed over them."""

    eval_min_rows = 1
    collective_eval = False  # predict() is the module's forward: no collective inside

    def __init__(self, module: nn.Module, team: Survivors) -> None:
        self.module, self.team = module, team

    @property
    def eval_shards(self) -> int:
        return self.team.comm.world_size

    @property
    def eval_shard(self) -> int:
        return self.team.comm.rank

    def before_eval(self) -> None:
        """Nothing to gather: :func:`finish` wrote the final values into the module."""

    def eval_modules(self) -> list[nn.Module]:
        return [self.module]

    def predict(self, inputs: Any) -> torch.Tensor:
        output: torch.Tensor = self.module(inputs)
        return output

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        return score_over(self.team, totals)


class ServerRun:
    """One server rank's run: built (model, shard, restored checkpoint) by the constructor,
    served and ended by :meth:`execute`; ``close`` releases the survivors' group."""

    def __init__(self, config: TrainConfig, comm: Communicator, micro: int) -> None:
        self.config, self.comm, self.micro = config, comm, micro
        self.roles = assign_roles(comm.world_size, num_servers(config))
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":  # the run's own peak, not an earlier run's
            torch.cuda.reset_peak_memory_stats(self.device)
        self.data = build_dataset(config.dataset, config.data)
        torch.manual_seed(config.seed)  # the workers' initial parameters, built as they are
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        self.module = build_model(config.model, self.data.info, config.model_config).to(
            self.device, self.dtype)
        self.throughput = throughput_of(self.module, self.data.info, comm.world_size,
                                        self.device, config.peak_tflops)
        workers = self.roles.num_workers
        shard = len(DistributedSampler(size(self.data.train), workers, 0, drop_last=True))
        self.per_step = micro * config.accumulate
        self.steps_per_epoch = shard // self.per_step  # as the workers' loop counts them
        if self.steps_per_epoch == 0:
            raise ValueError(f"global batch {config.global_batch} is larger than the training "
                             f"split ({shard * workers} samples); use a smaller global_batch")
        total = config.steps or (config.epochs or 1) * self.steps_per_epoch
        self.server: ParameterServer = build_parameter_server(
            comm, self.roles, self.module, server_optimizer(config, workers), ps_config(config))
        self.start_step = 0
        path = resume_from(config, self.roles)  # checked: same mode, same workers
        if path is not None:
            self.load_state(path, comm.rank)
        self.last_step = max(total, self.start_step)  # where the workers' loop ends
        self.team: Survivors | None = None

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, path: str, rank: int) -> None:
        """This server's shard of the checkpoint at ``path``: values, optimizer state,
        version and clock (its own sealed directory, ``ps-server-000``, …)."""
        self.server.checkpoint_dir = path
        self.server.save()

    def load_state(self, path: str, rank: int) -> None:
        """Restore this server's shard from ``path`` before serving; the run goes on at the
        checkpoint's step (the workers check that it is the clock the servers report)."""
        self.server.restore(checkpoint_path(path, self.server.shard.server))
        self.start_step = int(safe_load(os.path.join(path, "meta.pt"))["step"])

    # ------------------------------------------------------------------ the run
    def execute(self, loss_fn: LossFn) -> TrainResult:
        """Serve until every worker is done or lost, then the survivors' ending (the
        module docstring lists its collectives, in the order the workers' loop takes)."""
        report = self.server.serve()
        self.team = team = survivors(self.comm, self.roles, report.lost)
        shard = self.server.shard
        mean = finish(team, self.roles, shard.partition, self.module, 0.0, shard.param)
        evaluation = self._evaluate(team, loss_fn)
        if self.config.checkpoint_dir is not None and self.last_step > self.start_step:
            checkpoint.save(self.config.checkpoint_dir, self.last_step, self, team.comm,
                            {}, self._position(), rank=self.comm.rank)  # meta.pt: a worker's
        # the workers' mean in the dtype a worker reports its loss in, like theirs
        last = float(torch.tensor(mean, dtype=shard.param.dtype))
        return self._result(team, report, last, evaluation)

    def _evaluate(self, team: Survivors, loss_fn: LossFn) -> EvalPoint:
        autocast = autocast_factory(self.config.precision, self.device.type)
        accuracy, loss = evaluate(FinalModel(self.module, team), self.data.test, loss_fn,
                                  autocast, batch_size=max(self.micro, 256),
                                  device=self.device, dtype=self.dtype)
        epoch = max(self.last_step - 1, 0) // self.steps_per_epoch
        return EvalPoint(self.last_step, epoch, accuracy, loss)

    def _position(self) -> dict[str, int]:
        """The sampler position after the last step, as a worker's rank file holds it."""
        epoch, offset = divmod(self.last_step, self.steps_per_epoch)
        return {"epoch": epoch, "start": offset * self.per_step}

    def _result(self, team: Survivors, report: ServerReport, last: float,
                evaluation: EvalPoint) -> TrainResult:
        peak = peak_memory_bytes(self.device)
        shard = self.server.shard
        state = measure_state({"params": [shard.param, *self.module.parameters()],
                               "grads": [], "optimizer": optimizer_tensors(shard.optimizer)})
        # the loop's two gathers: a server sent nothing in steps and has no formula (-1)
        loss = torch.tensor([last], dtype=torch.float64)
        team.comm.all_reduce(loss)
        most = torch.tensor([float(peak), -1.0, -1.0, float(state.total), 0.0],
                            dtype=torch.float64)
        team.comm.all_reduce(most, op="max")
        peak_max, sent_max, theory_max, state_max, act_max = most.tolist()
        mine = [0.0] * 5 + [float(report.bytes_sent), float(report.bytes_recv)]
        extras = gather_extras(team, self.roles, ps_config(self.config),
                               mine + [0.0] * self.roles.num_workers, report.staleness)
        speed, config = self.throughput, self.config
        return TrainResult(
            strategy=config.strategy, rank=self.comm.rank, world_size=self.comm.world_size,
            dp_size=self.roles.num_workers, global_batch=config.global_batch,
            start_step=self.start_step, steps=self.last_step,
            steps_per_epoch=self.steps_per_epoch,
            final_loss=float(loss) / team.comm.world_size, accuracy=evaluation.accuracy,
            eval_loss=evaluation.loss, samples_per_s=0.0, step_times=[], losses=[],
            bytes_sent_per_step=None, bytes_unobserved=0, peak_mem_bytes=peak,
            peak_mem_bytes_max=int(peak_max), theory_bytes_per_step=None,
            bytes_sent_per_step_max=None if sent_max < 0 else sent_max,
            theory_bytes_per_step_max=None if theory_max < 0 else theory_max,
            extras=extras, evaluations=[evaluation], model_state_bytes=state.as_dict(),
            model_state_formula_bytes=None, activation_peak_bytes=0,
            model_state_bytes_max=int(state_max), activation_peak_bytes_max=int(act_max),
            tokens_per_sample=speed.tokens_per_sample,
            model_flops_per_token=speed.flops_per_token, devices=speed.devices,
            peak_tflops=speed.peak_tflops, model=self.module)

    def close(self) -> None:
        if self.team is not None and self.team.own_comm:
            self.team.comm.close()
        self.team = None
