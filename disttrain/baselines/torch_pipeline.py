"""``torch-gpipe``: torch.distributed.pipelining's ``PipelineStage`` + ``ScheduleGPipe`` over the
same split and micro-batch count as disttrain's ``gpipe``, as the benchmark's baseline.

The split is disttrain's (``partition.choose_balance`` through ``agreed_balance``, the same
function ``build_pipeline`` uses), cut by hand into stage modules: torch's own tracer
(``pipeline()`` with ``pipe_split``) is not needed for an ``nn.Sequential``. torch's schedule
splits the batch into equal micro-batches with ``tensor_split``, infers the activation
shapes on its first step and keeps them, so the local batch must divide by the micro-batch
count (checked before the run starts).

Evaluation does not go through torch's schedule (its cached receive shapes do not follow a
different batch size): each stage broadcasts its trained layers to every rank, and every
rank evaluates the whole, now identical, model. The loss of a step is the mean of the last
stage's micro-batch losses (torch scales gradients by 1/m: the full-batch gradient of the
mean loss), broadcast to every rank.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from disttrain.baselines.torch_data_parallel import native_group
from disttrain.train.strategies.base import Autocast, Batch, BuildContext, LossFn, Strategy
from disttrain.train.strategies.pipeline import (
    DEFAULT_MICROBATCHES,
    activation_sizes,
    pipeline_theory,
    stage_layers,
)


class TorchGPipeStrategy(Strategy):
    """This rank's ``PipelineStage``; every rank is one stage (no data parallelism)."""

    counts_bytes = False

    def __init__(self, ctx: BuildContext) -> None:
        from torch.distributed.pipelining import PipelineStage

        from disttrain.parallel.pipeline import layers_of
        from disttrain.parallel.pipeline.collectives import agreed_balance
        from disttrain.parallel.pipeline.partition import stage_module

        comm = ctx.require_comm("torch-gpipe")
        group = native_group(comm, "torch-gpipe")
        device = ctx.sample[0].device
        if device.type != comm.transport.device_type:  # Gloo would read GPU memory as host's
            raise ValueError(f"torch-gpipe sends torch's own messages, which disttrain cannot "
                             f"stage: on {device.type} it needs a backend that moves "
                             f"{device.type} tensors (--backend nccl for --device cuda)")
        self.microbatches = ctx.config.parallel.microbatches or DEFAULT_MICROBATCHES
        from disttrain.parallel.pipeline.partition import balance_at, layer_names

        given = ctx.config.parallel.partition or "params"
        inputs = ctx.sample[0]
        self.layers = layers_of(ctx.module)
        partition: str | tuple[int, ...] = given if isinstance(given, str) else (
            balance_at(layer_names(ctx.module, self.layers), [str(p) for p in given],
                       comm.world_size) if any(isinstance(p, str) for p in given) else
            tuple(int(p) for p in given))
        self.balance = agreed_balance(comm, self.layers, comm.world_size, partition,
                                      inputs[:max(1, len(inputs) // self.microbatches)],
                                      [comm.world_size, self.microbatches], "the torch-gpipe split")
        module = stage_module(self.layers, self.balance, comm.rank)
        params = list(module.parameters())
        super().__init__(module, ctx.make_optimizer(params) if params else None, comm)
        self.full = ctx.module
        self.is_first, self.is_last = comm.rank == 0, comm.rank == comm.world_size - 1
        self.stage: Any = PipelineStage(module, comm.rank, comm.world_size, device, group=group)
        self.schedule: Any = None  # made at the first step, when the loss function is known
        self.theory_bytes_per_step = pipeline_theory(
            activation_sizes(ctx.module, inputs), stage_layers(module), comm.rank,
            comm.world_size, self.microbatches, ctx.config.global_batch, headers=False)

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        from torch.distributed.pipelining import ScheduleGPipe

        (inputs, targets), = micro_batches
        if self.schedule is None:
            self.schedule = ScheduleGPipe(self.stage, self.microbatches, loss_fn=loss_fn)
        self.module.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.is_first else ()
        with autocast():
            self.schedule.step(*args, target=targets if self.is_last else None,
                               losses=losses if self.is_last else None)
        if self.optimizer is not None:
            self.optimizer.step()
        mean = sum(float(v.detach()) for v in losses) / len(losses) if losses else 0.0
        loss = torch.tensor([mean], dtype=torch.float64)
        assert self.comm is not None
        self.comm.broadcast(loss, self.comm.world_size - 1)
        return loss[0]

    def _synchronize(self) -> None:
        """Every stage broadcasts its layers' parameters and buffers: afterwards every rank's
        full model is the trained pipeline."""
        from disttrain.parallel.pipeline.partition import boundaries

        assert self.comm is not None
        with torch.no_grad():
            for stage, (start, end) in enumerate(boundaries(self.balance)):
                for layer in self.layers[start:end]:
                    for tensor in (*layer.parameters(), *layer.buffers()):
                        self.comm.broadcast(tensor.data, stage)

    def before_eval(self) -> None:
        self._synchronize()

    def eval_modules(self) -> list[nn.Module]:
        return [self.full]

    def predict(self, inputs: Any) -> torch.Tensor | None:
        output: torch.Tensor = self.full(inputs)
        return output

    def trained_module(self) -> nn.Module:
        self._synchronize()
        return self.full

    def close(self) -> None:
        self.schedule = None  # torch's stage and schedule hold the process group: drop them
        self.stage = None
        gc.collect()


def build_torch_gpipe(ctx: BuildContext) -> Strategy:
    return TorchGPipeStrategy(ctx)
