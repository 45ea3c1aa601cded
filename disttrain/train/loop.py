"""The training loop every strategy shares: ``train(config, comm) -> TrainResult``.

One call on every rank (all ranks must call it with the same config)::

    seed(config.seed) → build model (identical on every rank) → strategy wraps or splits it
    for each step:   this replica's shard of the global batch (DistributedSampler)
                     → strategy.train_step (forward, backward, gradient sync, update)
                     → strategy.after_step (measurements, outside the step's time)
                     → metrics line / progress bar / evaluation / checkpoint when due
    gather final loss, peak memory and bytes over ranks → TrainResult

The global batch is split evenly over the data-parallel replicas (and ``accumulate``
micro-batches each), so N replicas × b samples see exactly the samples one process sees
with batch N·b: that is what makes every strategy comparable with the single-process
reference. A replica is a rank for data parallelism and ZeRO, a whole pipeline for the
pipeline strategies (all its stages read the same shard).

Devices: the model is moved to the rank's device (``config.device``, :mod:`.device`) before
the strategy wraps it, and every batch is moved there as it is fetched; on CUDA the peak
memory is ``torch.cuda.max_memory_allocated``, counted from the start of the run. With
``precision="fp16"`` a :class:`~disttrain.parallel.mixed_precision.LossScaler` over the
strategy's communicator scales every loss and checks every update (``Strategy.
use_loss_scaler``); its scale and skipped steps are in the result's ``extras``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.train import checkpoint
from disttrain.train.batches import batch_aligner, model_loss, unpack_dict_inputs
from disttrain.train.config import TrainConfig
from disttrain.train.data import DatasetSplits, build_dataset, fetch, size
from disttrain.train.device import resolve_device, to_device
from disttrain.train.evaluate import evaluate
from disttrain.train.flops import throughput_of
from disttrain.train.loader import Prefetcher
from disttrain.train.memory import (
    ActivationTracker,
    formula_bytes,
    measure_state,
    state_bytes_per_param,
)
from disttrain.train.metrics import (
    ProgressBar,
    StepRecord,
    TensorBoard,
    format_line,
    format_rates,
    log,
    peak_memory_bytes,
)
from disttrain.train.models import build_model
from disttrain.train.precision import autocast_factory
from disttrain.train.ps_server import serve_run, serves_parameters
from disttrain.train.result import EvalPoint, TrainResult
from disttrain.train.sampler import DistributedSampler
from disttrain.train.schedule import LRSchedule, LRScheduler, check_schedule, torch_optimizers
from disttrain.train.strategies import BuildContext, Strategy, get_strategy, optimizer_factory
from disttrain.train.strategies.base import PhaseRecorder

Hook = Callable[[StepRecord], None]


def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
    """The model's own loss (a ``ModelOutput``'s ``.loss``: it was given labels), else the
    mean cross-entropy of its logits, targets of -100 left out; works for classes
    (B, C)/(B,) and tokens (B, T, V)/(B, T) (:mod:`disttrain.train.batches`)."""
    return model_loss(output, target)


def train(config: TrainConfig, comm: Communicator | None = None, *,
          hooks: Sequence[Hook] = (), phases: PhaseRecorder | None = None) -> TrainResult:
    """Run ``config`` on this rank (every rank of ``comm`` calls it) and return the result.

    ``phases``, when given, records every step's compute spans (forward, backward,
    optimizer; or the whole ``train_step`` of a strategy that overrides it) and receives the
    strategy's communicators, for timelines (``disttrain bench --trace``).

    A parameter server's rank (``ps-*``) runs no loop: it serves the workers, then ends the
    run with them (:func:`~disttrain.train.ps_server.serve_run`; ``hooks`` hear no step)."""
    if comm is not None and serves_parameters(config, comm):
        return serve_run(config, comm, checked_setup(config, comm.world_size), loss_fn, phases)
    run = _Run(config, comm, phases)
    try:
        return run.execute(hooks)
    finally:
        run.close()


@contextmanager
def single_steps(config: TrainConfig) -> Iterator[Callable[[], StepRecord]]:
    """Steps of ``config`` in this process without a communicator (``single``, or any
    strategy that needs none), one per call, each through the loop's own step: the batch
    fetched, the strategy's ``train_step``, the records. Cycles over the first epoch's
    batches and never evaluates, checkpoints or logs: for timing the loop's own work
    (``disttrain simulate``'s profile)."""
    run = _Run(dataclasses.replace(config, log_every=0, progress=False), None)
    run.tracked_steps = 0  # no saved-tensor hooks: these steps are timed
    try:
        indices, per_step = run.sampler.indices(), run.per_step
        batches, taken = len(indices) // per_step, 0

        def step() -> StepRecord:
            nonlocal taken
            k = taken % batches
            taken += 1
            return run._one_step(0, run._fetch_step(indices[k * per_step:(k + 1) * per_step]))
        yield step
    finally:
        run.close()


def checked_setup(config: TrainConfig, world_size: int) -> int:
    """Validate what can be checked before starting ranks; returns the micro-batch size."""
    spec = get_strategy(config.strategy)
    check_schedule(config.strategy, spec, config.lr_schedule, config.warmup_steps)
    return config.micro_batch(spec.check_config(config, world_size))


class _Run:
    """The state of one run; ``execute`` is the loop."""

    def __init__(self, config: TrainConfig, comm: Communicator | None,
                 phases: PhaseRecorder | None = None) -> None:
        self.config, self.comm, self.phases = config, comm, phases
        self.rank = comm.rank if comm is not None else 0
        self.world_size = comm.world_size if comm is not None else 1
        spec = get_strategy(config.strategy)
        self.micro = checked_setup(config, self.world_size)
        if spec.needs_comm and comm is None:
            raise ValueError(f"strategy {config.strategy!r} needs a communicator")
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":  # the run's own peak, not an earlier run's
            torch.cuda.reset_peak_memory_stats(self.device)
        self.data: DatasetSplits = build_dataset(config.dataset, config.data)
        torch.manual_seed(config.seed)  # identical initial parameters on every rank
        self.dtype: torch.dtype = getattr(torch, config.dtype)
        module = _build_module(config, self.data.info, self.device, self.dtype)
        self.numel = sum(p.numel() for p in module.parameters() if p.requires_grad)  # Ψ
        unpack_dict_inputs(module)  # a dict batch is the model's keyword arguments
        self.align = batch_aligner(module)  # a causal LM's labels, aligned with its logits
        self.throughput = throughput_of(module, self.data.info, self.world_size, self.device,
                                        config.peak_tflops)  # tokens/s and MFU
        sample = to_device(self.align(fetch(self.data.train, list(range(
            min(self.micro, size(self.data.train)))))), self.device, self.dtype)
        self.strategy: Strategy = spec.make(
            BuildContext(module, comm, optimizer_factory(config), config, sample))
        self.scaler = _loss_scaler(config, comm, self.strategy)
        self.clipper = _grad_clipper(config, self.strategy, self.scaler)  # after the scaler
        _wrap_blocks(config, self.strategy)
        self.loss_fn = _training_loss(self.strategy.module)
        if phases is not None:
            self.strategy.phases = phases
            phases.communicators = self.strategy.communicators()
        # a strategy with its own train_step (pipelines) gets one span for the whole call
        self.whole_step = phases is not None and (
            type(self.strategy).train_step is not Strategy.train_step)
        try:
            self._setup()
        except BaseException:
            self.strategy.close()
            raise

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        config = self.config
        torch.manual_seed(config.seed + 1 + self.rank)  # per-rank stream (e.g. dropout)
        self.sampler = DistributedSampler(size(self.data.train), self.strategy.dp_size,
                                          self.strategy.dp_rank, shuffle=True,
                                          seed=config.seed, drop_last=True)
        self.per_step = self.micro * config.accumulate
        self.steps_per_epoch = len(self.sampler) // self.per_step
        if self.steps_per_epoch == 0:
            raise ValueError(f"global batch {config.global_batch} is larger than the training "
                             f"split ({len(self.sampler) * self.strategy.dp_size} samples); "
                             f"use a smaller global_batch")
        self.total_steps = config.steps or (config.epochs or 1) * self.steps_per_epoch
        self.autocast = autocast_factory(config.precision, self.device.type)
        self.meta = {"model": config.model, "dataset": config.dataset,
                     "data": config.data.identity(), "global_batch": config.global_batch,
                     "seed": config.seed, "world_size": self.world_size}
        self.step, self.start_step = 0, 0
        self.step_times: list[float] = []
        self.losses: list[float] = []
        self.bytes_sent: list[int] = []
        self.bytes_unobserved = 0
        self.evaluations: list[EvalPoint] = []
        # the untimed steps (at least one) run under saved-tensor hooks, outside samples/s
        self.activations = ActivationTracker()
        self.tracked_steps = max(1, config.untimed_steps)
        self.schedule = LRSchedule(config.lr_schedule, config.lr, config.warmup_steps,
                                   config.min_lr, self.total_steps)
        self.learning_rates: list[float] = []
        # base rates read now, before a resume loads the rates of its step into the groups
        self.scheduler = LRScheduler(self.schedule, lambda: torch_optimizers(self.strategy)) \
            if self.schedule.varies else None
        if self.schedule.varies:  # a resume must continue the same curve (checkpoint.load)
            self.meta["lr_schedule"] = self.schedule.state_dict()
        show = config.progress if config.progress is not None else sys.stderr.isatty()
        self.progress = ProgressBar(self.total_steps, enabled=show and self.rank == 0)
        self.tensorboard = TensorBoard(config.tensorboard_dir if self.rank == 0 else None)
        self._resume()

    def _resume(self) -> None:
        directory = self.config.checkpoint_dir
        if not self.config.resume or directory is None:
            return
        path = checkpoint.latest(directory)
        if path is None:
            log.info("no checkpoint in %s yet: starting from step 0", directory)
            return
        resumed = checkpoint.load(path, self.strategy, self.rank, self.meta, self.scaler)
        self.step = self.start_step = resumed.step
        if resumed.sampler is not None:
            self.sampler.load_state_dict(resumed.sampler)
        log.info("resumed from %s at step %d", path, self.step)

    def _position(self) -> dict[str, int]:
        """The sampler position of the next step (epoch, index in this rank's shard)."""
        epoch, offset = divmod(self.step, self.steps_per_epoch)
        return {"epoch": epoch, "start": offset * self.per_step}

    # ------------------------------------------------------------------ the loop
    def execute(self, hooks: Sequence[Hook]) -> TrainResult:
        log.debug("training steps %d..%d, %d per epoch, micro-batch %d on rank %d",
                  self.step + 1, self.total_steps, self.steps_per_epoch, self.micro, self.rank)
        self.sampler.load_state_dict(self._position())
        # loader threads read the next steps' batches while this one computes (.loader)
        jobs = self.sampler.batches(self.per_step, self.total_steps - self.step)
        with Prefetcher(jobs, lambda job: (job[0], self._fetch_step(job[1])),
                        self.config.data.loader_workers, self.config.data.prefetch) as batches:
            for epoch, micro in batches:
                record = self._one_step(epoch, micro, waited_s=batches.waited_s)
                for hook in hooks:
                    hook(record)
                self.sampler.load_state_dict(self._position())
                self._after_step(record, end_of_epoch=self.step % self.steps_per_epoch == 0)
        if not self.evaluations or self.evaluations[-1].step != self.step:
            self._evaluate()
        self._checkpoint(final=True)
        self.progress.close()
        return self._result()

    def _fetch_step(self, indices: torch.Tensor) -> list[tuple[Any, Any]]:
        """One step's micro-batches, read on the host (on a loader thread)."""
        return [self.align(fetch(self.data.train, indices[m * self.micro:(m + 1) * self.micro]))
                for m in range(self.config.accumulate)]

    def _one_step(self, epoch: int, batches: list[tuple[Any, Any]],
                  waited_s: float = 0.0) -> StepRecord:
        """One step on ``batches``; its time counts ``waited_s``, the wait for them."""
        lr = self.scheduler.set_step(self.step) if self.scheduler is not None else self.config.lr
        self.learning_rates.append(lr)
        start_time = time.perf_counter() - waited_s
        sent_before = self._bytes_sent()
        hidden_before = self._bytes_unobserved()
        micro = [to_device(batch, self.device, self.dtype) for batch in batches]
        tracking = len(self.step_times) < self.tracked_steps
        with self.activations if tracking else contextlib.nullcontext():
            if self.whole_step and self.phases is not None:
                with self.phases.span("train_step"):
                    loss = float(self.strategy.train_step(micro, self.loss_fn, self.autocast))
            else:
                loss = float(self.strategy.train_step(micro, self.loss_fn, self.autocast))
        seconds = time.perf_counter() - start_time
        sent_after = self._bytes_sent()
        self.bytes_unobserved += self._bytes_unobserved() - hidden_before
        self.strategy.after_step()
        self.step += 1
        sent = None if sent_after is None or sent_before is None else sent_after - sent_before
        self.step_times.append(seconds)
        self.losses.append(loss)
        if sent is not None:
            self.bytes_sent.append(sent)
        norm = self.clipper.norms[-1] if self.clipper is not None and self.clipper.norms \
            else None
        return StepRecord(self.step, epoch, loss, seconds, sent, norm, lr)

    def _bytes_sent(self) -> int | None:
        """Bytes sent so far through every communicator of the strategy (a pipeline in a
        pp × dp grid also sends through its sub-communicators)."""
        if self.comm is None or not self.strategy.counts_bytes:
            return None
        return sum(c.stats.bytes_sent for c in self.strategy.communicators())

    def _bytes_unobserved(self) -> int:
        return sum(c.stats.bytes_unobserved for c in self.strategy.communicators())

    def _after_step(self, record: StepRecord, end_of_epoch: bool) -> None:
        config = self.config
        self.progress.update(record.step, record.loss)
        if config.log_every and record.step % config.log_every == 0:
            self._log(record)
        every = config.eval_every
        if (every is None and end_of_epoch) or (every and record.step % every == 0):
            self._evaluate()
        if config.checkpoint_every and record.step % config.checkpoint_every == 0:
            self._checkpoint()

    def _log(self, record: StepRecord) -> None:
        window = self.step_times[-self.config.log_every:]
        samples_per_s = self.config.global_batch * len(window) / max(sum(window), 1e-12)
        line = format_line(record.step, record.epoch, record.loss, samples_per_s,
                           self._bytes_sent(), peak_memory_bytes(self.device),
                           self._bytes_unobserved(), grad_norm=record.grad_norm)
        lr, speed = self.learning_rates[-1], self.throughput
        line += format_rates(lr, speed.tokens_per_s(samples_per_s), speed.mfu(samples_per_s))
        log.log(logging.INFO if self.rank == 0 else logging.DEBUG, "%s", line)
        self.tensorboard.scalars(record.step, {"train/loss": record.loss,
                                               "train/samples_per_s": samples_per_s,
                                               "train/lr": lr})

    def _evaluate(self) -> None:
        accuracy, loss = evaluate(self.strategy, self.data.test, loss_fn, self.autocast,
                                  batch_size=max(self.micro, 256), device=self.device,
                                  dtype=self.dtype, align=self.align)
        epoch = max(self.step - 1, 0) // self.steps_per_epoch
        self.evaluations.append(EvalPoint(self.step, epoch, accuracy, loss))
        if self.rank == 0:
            log.info("eval step=%d epoch=%d accuracy=%.4f eval_loss=%.4f",
                     self.step, epoch, accuracy, loss)
        self.tensorboard.scalars(self.step, {"eval/accuracy": accuracy, "eval/loss": loss})

    def _checkpoint(self, final: bool = False) -> None:
        directory = self.config.checkpoint_dir
        if directory is None or self.step == 0:
            return
        if final and self.config.checkpoint_every and self.step % self.config.checkpoint_every == 0:
            return  # already written after the last step
        if final and self.step == self.start_step:
            return  # nothing new since the checkpoint we resumed from
        checkpoint.save(directory, self.step, self.strategy, self._result_comm(), self.meta,
                        self._position(), self.scaler, rank=self.rank)

    def _result_comm(self) -> Communicator | None:
        """The ranks that finish the run: every rank, unless the strategy lost some."""
        survivors = self.strategy.result_comm()
        return self.comm if survivors is None else survivors

    # ------------------------------------------------------------------ the result
    def _gathered(self, peak: int, state: int) -> tuple[float, list[float | None]]:
        """Mean of the last step's loss over the ranks that finish the run (the strategy's
        ``result_comm``: every rank, unless some were lost); the maxima over them of peak
        memory (this rank's: ``peak``), mean bytes sent per step, the theoretical bytes per
        step (None: not known), model-state bytes (``state``) and peak activation bytes."""
        last = self.losses[-1] if self.losses else float("nan")
        sent = self.bytes_sent if self._bytes_sent() is not None else []
        theory = self.strategy.theory_bytes_per_step
        mine = [float(peak), sum(sent) / len(sent) if sent else -1.0,
                -1.0 if theory is None else float(theory), float(state),
                float(self.activations.peak)]
        comm = self._result_comm()
        if comm is not None and comm.world_size > 1:
            loss = torch.tensor([last], dtype=torch.float64)
            comm.all_reduce(loss)
            last = float(loss) / comm.world_size
            most = torch.tensor(mine, dtype=torch.float64)
            comm.all_reduce(most, op="max")
            mine = most.tolist()
        return last, [None if v < 0 else v for v in mine]

    def _result(self) -> TrainResult:
        # read once: the peak can still grow while the maxima are gathered, and a rank's own
        # peak must never exceed the maximum reported over all ranks
        peak = peak_memory_bytes(self.device)
        state = measure_state(self.strategy.model_state_tensors())  # before trained_module
        formula = formula_bytes(self.strategy.zero_stage, self.numel, self.strategy.dp_size,
                                state_bytes_per_param(self.config.optimizer,
                                                      self.config.momentum))
        final_loss, (peak_max, sent_max, theory_max, state_max, act_max) = self._gathered(
            peak, state.total)
        warm = self.config.untimed_steps
        timed = self.step_times[warm:] if len(self.step_times) > warm else self.step_times
        samples_per_s = self.config.global_batch * len(timed) / sum(timed) if timed else 0.0
        last_eval = self.evaluations[-1] if self.evaluations else None
        extras = self.strategy.extras(warm)
        if self.scaler is not None:
            extras = {**extras, "loss_scale": self.scaler.scale_value,
                      "skipped_steps": self.scaler.skipped_steps}
        return TrainResult(
            strategy=self.config.strategy, rank=self.rank, world_size=self.world_size,
            dp_size=self.strategy.dp_size, global_batch=self.config.global_batch,
            start_step=self.start_step, steps=self.step, steps_per_epoch=self.steps_per_epoch,
            final_loss=final_loss, accuracy=last_eval.accuracy if last_eval else None,
            eval_loss=last_eval.loss if last_eval else None, samples_per_s=samples_per_s,
            step_times=self.step_times, losses=self.losses,
            bytes_sent_per_step=self.bytes_sent if self._bytes_sent() is not None else None,
            bytes_unobserved=self.bytes_unobserved,
            peak_mem_bytes=peak, peak_mem_bytes_max=int(peak_max or 0),
            theory_bytes_per_step=self.strategy.theory_bytes_per_step,
            bytes_sent_per_step_max=sent_max, theory_bytes_per_step_max=theory_max,
            extras=extras, evaluations=self.evaluations,
            model_state_bytes=state.as_dict(),
            model_state_formula_bytes=None if formula is None else formula.as_dict(),
            activation_peak_bytes=self.activations.peak,
            model_state_bytes_max=int(state_max or 0),
            activation_peak_bytes_max=int(act_max or 0), learning_rates=self.learning_rates,
            tokens_per_sample=self.throughput.tokens_per_sample,
            model_flops_per_token=self.throughput.flops_per_token,
            devices=self.throughput.devices, peak_tflops=self.throughput.peak_tflops,
            model=self.strategy.trained_module())

    def close(self) -> None:
        self.tensorboard.close()
        self.strategy.close()


def _training_loss(module: nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """The loss a step minimizes: cross-entropy, plus a mixture-of-experts model's
    load-balancing loss (train/moe.py); evaluation reports the cross-entropy alone."""
    from disttrain.train.moe import add_aux_loss, moe_layers

    return add_aux_loss(loss_fn, module) if moe_layers(module) else loss_fn


def _wrap_blocks(config: TrainConfig, strategy: Strategy) -> None:
    """--compile and --activation-checkpointing, on the blocks of the module the strategy
    trains (a shard, a stage, the model: train/blocks.py)."""
    from disttrain.train.blocks import apply_activation_checkpointing, compile_blocks

    blocks = strategy.block_module()
    if config.compile:
        compile_blocks(blocks, config.compile_backend)
    apply_activation_checkpointing(blocks, config.activation_checkpointing)


def _build_module(config: TrainConfig, info: Any, device: torch.device,
                  dtype: torch.dtype) -> torch.nn.Module:
    """The model, the same on every rank (the seed is set); ``--meta-init``: shapes only,
    on the meta device, for ZeRO to materialise each rank's shards one unit at a time."""
    if not config.parallel.meta_init:
        return build_model(config.model, info, config.model_config).to(device, dtype)
    with torch.device("meta"):
        return build_model(config.model, info, config.model_config).to(dtype)


def _grad_clipper(config: TrainConfig, strategy: Strategy, scaler: Any) -> Any:
    """--clip-grad-norm: clip the whole model's gradient before every update of
    ``strategy`` (after fp16's scaler unscaled it: its hook is registered first)."""
    if config.clip_grad_norm is None:
        return None
    from disttrain.train.clipping import GradClipper

    clipper = GradClipper(strategy, config.clip_grad_norm, scaler)
    strategy.use_grad_clipping(clipper)
    return clipper


def _loss_scaler(config: TrainConfig, comm: Communicator | None, strategy: Strategy) -> Any:
    """fp16: the dynamic loss scaler every update of ``strategy`` goes through, deciding
    over ``comm`` (all ranks, every stage of every pipeline) which steps to skip."""
    if config.precision != "fp16":
        return None
    from disttrain.parallel.mixed_precision import LossScaler

    scaler = LossScaler(comm)
    strategy.use_loss_scaler(scaler)
    return scaler

