"""DeepSpeed's engine as baseline rows: ``deepspeed-ddp`` (ZeRO stage 0, plain data
parallelism, what the DistributedTest benchmark ran) and ``deepspeed-zero1/2/3``.

DeepSpeed is optional (``pip install 'disttrain[baselines]'``); without it these rows are
refused before any rank starts, with the install command, and ``disttrain bench`` skips them
with that note. On CPU DeepSpeed picks its CPU accelerator and, finding torch.distributed
already initialized (the benchmark's Gloo group), runs its collectives there: its traffic
bypasses disttrain.comm and is not counted (the theoretical bytes are given).

The engine gets the config's torch optimizer (``zero_allow_untested_optimizer``), the same
micro-batch and accumulation as every other row, and buckets the size of torch DDP's (its
own default reduce bucket is 5·10⁸ elements, 2 GB in fp32, allocated on first use).
``engine.backward`` averages over the data-parallel ranks and divides by the accumulation
steps itself, so this row does not divide its micro-batch losses.

Model-state bytes: the module's parameters, DeepSpeed's flat copies and partitions, the
inner optimizer's state and every other tensor the ZeRO optimizer object holds (its gradient
partitions and buckets), each storage once. In fp32 DeepSpeed still keeps an fp32 master
partition beside the parameters, which the ZeRO paper's fp32 formula does not count.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from disttrain.baselines.torch_data_parallel import empty_copy
from disttrain.parallel.mixed_precision import accumulate, at_least_fp32
from disttrain.train.config import TrainConfig
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    Strategy,
    optimizer_class,
    param_bytes,
    ring_all_reduce_bytes,
)

INSTALL = "pip install 'disttrain[baselines]' (or pip install deepspeed)"
BUCKET_ELEMENTS = 25 * 2**20 // 4  # torch DDP's 25 MiB of fp32


def available() -> bool:
    """Whether DeepSpeed is installed (found, not imported: importing it takes a second and
    logs its accelerator choice)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def unavailable() -> str | None:
    """Why DeepSpeed's rows cannot run here (one line), or None."""
    return None if available() else f"DeepSpeed is not installed: {INSTALL}"


def check_installed(config: TrainConfig, world_size: int, dp: int) -> None:
    """Refuse a DeepSpeed row before any rank starts when DeepSpeed is not installed."""
    if not available():
        raise ValueError(f"strategy {config.strategy!r} needs DeepSpeed, which is not "
                         f"installed here; {INSTALL}")
    if config.precision != "fp32":
        raise ValueError(f"strategy {config.strategy!r} runs in fp32 only (DeepSpeed's bf16 "
                         f"mode keeps its own master weights); use --precision fp32")


def _tensors(obj: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors in ``obj`` and in the lists, tuples and dicts it holds (``depth`` levels)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth - 1)


def refuse_float64(ctx: BuildContext, name: str) -> None:
    """DeepSpeed's data-parallel and pipeline engines reduce fp32/fp16/bf16 gradients only
    and assert on float64, after the whole set-up: refuse such a model first, in one line."""
    if any(p.dtype == torch.float64 for p in ctx.module.parameters()):
        raise ValueError(f"{name} reduces fp32, fp16 and bf16 gradients only, not this "
                         f"float64 model's; use --dtype float32")


class DeepSpeedStrategy(Strategy):
    """One DeepSpeed ZeRO stage (0: data parallel) driving the module."""

    counts_bytes = False

    def __init__(self, ctx: BuildContext, stage: int) -> None:
        if stage == 0:  # ZeRO 1-3 keep float64 (their own reduction)
            refuse_float64(ctx, ctx.config.strategy)
        if not torch.cuda.is_available():  # CPU: say so, rather than have DeepSpeed warn
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        # DeepSpeed logs and prints (the build of its CPU ops) on stdout, where the
        # benchmark's table goes: its logger is made at import, on the stream of the moment
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        name = ctx.config.strategy
        comm = ctx.require_comm(name)
        config = ctx.config
        micro = config.global_batch // comm.world_size // config.accumulate
        cls, kwargs = optimizer_class(config)
        self._skeleton = empty_copy(ctx.module)  # the result's module, filled at the end
        psi = param_bytes(ctx.module)
        optimizer = cls(ctx.module.parameters(), **kwargs)
        # DeepSpeed reads the launcher's variables (torchrun sets them; local ranks set none)
        for var, value in (("LOCAL_RANK", comm.rank), ("RANK", comm.rank),
                           ("WORLD_SIZE", comm.world_size)):
            os.environ.setdefault(var, str(value))
        with contextlib.redirect_stdout(sys.stderr):
            engine, ds_optimizer = self._initialize(deepspeed, ctx, optimizer, micro, stage)
        super().__init__(ctx.module, None, comm, engine)
        self.engine, self.ds_optimizer, self.stage = engine, ds_optimizer, stage
        self.zero_stage = stage
        self.collective_eval = stage == 3  # forward gathers the partitioned parameters
        p = comm.world_size
        self.theory_bytes_per_step = (ring_all_reduce_bytes(p, psi) if stage < 3
                                      else 3 * (p - 1) / p * psi)

    @staticmethod
    def _initialize(deepspeed: Any, ctx: BuildContext, optimizer: torch.optim.Optimizer,
                    micro: int, stage: int) -> tuple[Any, Any]:
        config = ctx.config
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=ctx.module, optimizer=optimizer, dist_init_required=False, config={
                "train_batch_size": config.global_batch,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": config.accumulate,
                "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET_ELEMENTS,
                                      "allgather_bucket_size": BUCKET_ELEMENTS,
                                      "stage3_prefetch_bucket_size": BUCKET_ELEMENTS},
                "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1,
                "wall_clock_breakdown": False})
        return engine, ds_optimizer

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        """DeepSpeed's loop: backward and step on every micro-batch (the engine steps the
        optimizer at the accumulation boundary and divides the loss by its count)."""
        self.engine.train()
        total: torch.Tensor | None = None
        for inputs, targets in micro_batches:
            with self.phase("forward"), autocast():
                loss = loss_fn(self.engine(inputs), targets)
            with self.phase("backward"):
                self.engine.backward(loss)
            with self.phase("optimizer"):
                self.engine.step()
            total = accumulate(total, loss / len(micro_batches))
        assert total is not None  # the loop passes at least one micro-batch
        return total

    def eval_modules(self) -> list[nn.Module]:
        return [self.engine]

    def predict(self, inputs: Any) -> torch.Tensor | None:
        output: torch.Tensor = self.engine(inputs)
        return output

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        params: list[torch.Tensor] = list(self.module.parameters())
        params += [t for p in self.module.parameters()
                   if isinstance(t := getattr(p, "ds_tensor", None), torch.Tensor)]
        inner = getattr(self.ds_optimizer, "optimizer", self.ds_optimizer)
        from disttrain.train.memory import optimizer_tensors

        optimizer = optimizer_tensors(inner)
        mine = {t.untyped_storage().data_ptr() for t in [*params, *optimizer]}
        held = [t for value in vars(self.ds_optimizer).values() for t in _tensors(value)
                if t.untyped_storage().data_ptr() not in mine]
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return {"params": params, "grads": grads + held, "optimizer": optimizer}

    def trained_module(self) -> nn.Module:
        """The plain module with every parameter (stage 3: gathered, a collective)."""
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        params = list(self.module.parameters())
        with GatheredParameters(params, enabled=self.stage == 3):
            full = {n: p.detach().clone() for n, p in self.module.named_parameters()}
        buffers = dict(self.module.named_buffers())
        for name, param in self._skeleton.named_parameters():
            param.data = full[name]
        for name, buffer in self._skeleton.named_buffers():
            buffer.data = buffers[name].detach().clone()
        return self._skeleton

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
        self.model = self.module
        self.engine = self.ds_optimizer = None
        gc.collect()


def build_deepspeed(stage: int) -> Any:
    def build(ctx: BuildContext) -> Strategy:
        return DeepSpeedStrategy(ctx, stage)

    return build


def _pipe_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loop's loss (mean cross-entropy over classes or tokens), for DeepSpeed's last
    stage, which computes it itself."""
    return torch.nn.functional.cross_entropy(at_least_fp32(output.flatten(0, -2)),
                                             target.flatten())


class DeepSpeedPipeStrategy(Strategy):
    """DeepSpeed's pipeline engine (``deepspeed.pipe``): the Sequential's layers cut into one
    stage per rank by parameter count, ``--microbatches`` micro-batches per step under
    DeepSpeed's 1F1B-style TrainSchedule, ZeRO stage 0. Every rank reads the same batch
    (layout ``model``); the last stage computes the loss and DeepSpeed broadcasts it."""

    counts_bytes = False
    collective_eval = True  # evaluation runs the inference schedule on every stage

    def __init__(self, ctx: BuildContext) -> None:
        from disttrain.train.strategies.pipeline import DEFAULT_MICROBATCHES

        refuse_float64(ctx, "deepspeed-pipe")
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        with contextlib.redirect_stdout(sys.stderr):
            import deepspeed
            from deepspeed.pipe import PipelineModule
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        comm = ctx.require_comm("deepspeed-pipe")
        for var, value in (("LOCAL_RANK", comm.rank), ("RANK", comm.rank),
                           ("WORLD_SIZE", comm.world_size)):
            os.environ.setdefault(var, str(value))
        config = ctx.config
        self.microbatches = config.parallel.microbatches or DEFAULT_MICROBATCHES
        self._skeleton = empty_copy(ctx.module)
        with contextlib.redirect_stdout(sys.stderr):
            deepspeed.init_distributed(dist_backend="gloo")  # adopts the existing group
            pipe = PipelineModule(layers=list(ctx.module.children()),
                                  num_stages=comm.world_size, loss_fn=_pipe_loss,
                                  partition_method="parameters")
            cls, kwargs = optimizer_class(config)
            engine, _, _, _ = deepspeed.initialize(
                model=pipe, optimizer=cls(pipe.parameters(), **kwargs), config={
                    "train_batch_size": config.global_batch,
                    "train_micro_batch_size_per_gpu": config.global_batch // self.microbatches,
                    "gradient_accumulation_steps": self.microbatches,
                    "zero_allow_untested_optimizer": True, "steps_per_print": 2**31 - 1})
        super().__init__(pipe, None, comm, engine)
        self.engine = engine
        self.theory_bytes_per_step = None

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def dp_rank(self) -> int:
        return 0

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        inputs, targets = micro_batches[0]
        chunks = list(zip(inputs.chunk(self.microbatches), targets.chunk(self.microbatches)))
        with autocast():
            loss = self.engine.train_batch(iter(chunks))
        return at_least_fp32(loss.detach())

    def eval_modules(self) -> list[nn.Module]:
        return [self.engine]

    def predict(self, inputs: Any) -> torch.Tensor | None:
        """One evaluation batch as one micro-batch through the stages; the last returns
        the output. DeepSpeed sizes its stage buffers by the first message, so they are
        reset around every batch of a new size (training's micro-batches included)."""
        self.engine.reset_activation_shape()
        self.engine.total_loss = None  # without a loss the engine sums the outputs there
        dummy = torch.zeros(len(inputs), dtype=torch.long)
        outputs = self.engine.eval_batch(iter([(inputs, dummy)]), compute_loss=False,
                                         reduce_output=None, bcast_loss=False,
                                         num_micro_batches=1)
        self.engine.reset_activation_shape()
        self.engine.total_loss = None
        if not self.engine.is_last_stage():
            return None
        return outputs[0] if isinstance(outputs, list) else outputs  # type: ignore[no-any-return]

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        """Only the last stage scored: the sum over the stages is its scores, everywhere."""
        assert self.comm is not None
        self.comm.all_reduce(totals)
        return totals

    def trained_module(self) -> nn.Module:
        """This rank's stage: its layers' parameters under the Sequential's own names (a
        pipeline rank returns its part, like ``gpipe``)."""
        return self.module

    def close(self) -> None:
        destroy = getattr(self.engine, "destroy", None)
        if destroy is not None:
            destroy()
        self.model = self.module
        self.engine = None
        gc.collect()


def build_deepspeed_pipe(ctx: BuildContext) -> Strategy:
    return DeepSpeedPipeStrategy(ctx)


def check_pipe(config: TrainConfig, world_size: int, dp: int) -> None:
    check_installed(config, world_size, dp)
    from disttrain.train.strategies.pipeline import DEFAULT_MICROBATCHES

    m = config.parallel.microbatches or DEFAULT_MICROBATCHES
    if config.global_batch % m:
        raise ValueError(f"deepspeed-pipe needs equal micro-batches: global batch "
                         f"{config.global_batch} does not split into {m}; use a --global-batch "
                         f"that is a multiple of {m}, or other --microbatches")
    if config.checkpoint_dir is not None:
        raise ValueError("deepspeed-pipe is a benchmark baseline and writes no checkpoints")
