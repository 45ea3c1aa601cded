"""``3d`` with pp > 1: the pipeline engine (:mod:`disttrain.parallel.pipeline`) on this
rank's tensor-parallel shard, over the mesh's pp and dp groups.

The shard is an ``nn.Sequential`` like the model it came from (embeddings, blocks, final
norm, head), so the pipeline cuts it between layers as it would cut the unsplit model; the
tp ranks of a stage run the same schedule, so their collectives meet in the same order,
and each sends its activations to the same tp rank of the next stage. The last stage's loss
is the vocabulary-parallel cross-entropy; after the pipeline has averaged each stage's
gradients over dp, the sequence-parallel gradients of the stage are summed over tp.

Activations are counted by the stage itself (``peak_activation_bytes``, every micro-batch
in flight; a probe of one block would hide the tensors from the stage's own count, as
saved-tensor hooks do not nest).

Bytes per rank per step: the pipeline's messages (``pipeline_theory``; with SP each
message is the rank's 1/t of the sequence), the dp all-reduce of the stage's gradients and
loss, and the TP collectives of the stage's layers for each micro-batch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.mesh import DeviceMesh
from disttrain.parallel.mixed_precision import at_least_fp32
from disttrain.parallel.tensor import full_state_dict
from disttrain.parallel.tensor import theory as tp_theory
from disttrain.parallel.tensor.ops import gather_vocab
from disttrain.parallel.tensor.transformer import (
    TensorParallelLM,
    lm_shape,
    reduce_sequence_parallel_grads,
    sequence_parallel_parameters,
)
from disttrain.parallel.universal import Split
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    placed_like,
    ring_all_reduce_bytes,
)
from disttrain.train.strategies.mesh import MeshSettings
from disttrain.train.strategies.pipeline import (
    PipelineSettings,
    PipelineStrategy,
    activation_sizes,
    pipeline_theory,
    stage_layers,
)
from disttrain.train.transformer import TransformerLM


class TensorPipelineStrategy(PipelineStrategy):
    """``3d`` with pp > 1: the pipeline engine on this rank's TP shard (its stage)."""

    def __init__(self, ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings,
                 shard: TensorParallelLM) -> None:
        from disttrain.parallel.pipeline import build_pipeline

        self.mesh, self.mesh_settings = mesh, settings
        self.shard = shard
        microbatches, schedule = settings.microbatches, settings.schedule or "1f1b"
        partition = ctx.config.parallel.partition or "params"
        pipe = build_pipeline(shard if shard is not None else ctx.module, mesh.world,
                              schedule=schedule, microbatches=microbatches,
                              partition=partition, mesh=mesh)
        super().__init__(ctx, pipe, PipelineSettings(schedule, microbatches, mesh.pp_rank,
                                                     mesh.pp_size, mesh.dp_rank, mesh.dp_size))
        self._sp_params = sequence_parallel_parameters(pipe.module) if (
            settings.sequence_parallel and shard is not None) else []
        self.collective_eval = True
        self.theory_bytes_per_step = self._mesh_theory(ctx, microbatches)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.shard is not None:
            return self.shard.loss(output, target)
        return F.cross_entropy(at_least_fp32(output.flatten(0, -2)), target.flatten())

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        (inputs, targets), = micro_batches  # the config check allows no accumulation here
        self.module.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = self.pipe.train_step(inputs if self.pipe.is_first else None,
                                        targets if self.pipe.is_last else None, self._loss)
        if self.shard is not None:
            reduce_sequence_parallel_grads(self._sp_params, self.shard.group)
        if self.optimizer is not None:
            self.optimizer.step()
        elif self.clipper is not None:
            self.clipper.no_update()  # a stage without parameters takes part in the norm
        return torch.tensor(loss, dtype=torch.float64)

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        """This stage's slice: split parameters on every tp rank, replicated ones on tp
        rank 0, all on replica 0; summed over the whole mesh."""
        from disttrain.train.clipping import tp_share

        return tp_share(self.module, self.mesh), self.mesh.world

    def predict(self, inputs: Any) -> torch.Tensor | None:
        output = super().predict(inputs)
        if output is None or self.shard is None:
            return output
        return gather_vocab(output, self.shard.group)  # every tp rank of the last stage

    def tensor_splits(self) -> dict[int, Split]:
        from disttrain.parallel.universal import tensor_parallel_splits

        return tensor_parallel_splits(self.module, self.mesh.tp_rank, self.mesh.tp_size)

    def tensor_rank(self) -> int:
        return self.mesh.tp_rank

    def _state_file(self, path: str) -> str:
        s, m = self.settings, self.mesh
        return os.path.join(path, f"state-stage{s.stage:05d}-of-{s.pp_size:05d}-tp"
                                  f"{m.tp_rank:05d}-of-{m.tp_size:05d}.pt")

    def _mesh_theory(self, ctx: BuildContext, microbatches: int) -> float | None:
        if ctx.config.precision != "fp32":
            return None
        m, t, sp = self.mesh, self.mesh.tp_size, self.mesh_settings.sequence_parallel
        local = ctx.config.global_batch // m.dp_size
        layers = stage_layers(self.module)
        sizes = [size // t if sp else size for size in activation_sizes(ctx.module,
                                                                         ctx.sample[0])]
        sent = pipeline_theory(sizes, layers, m.pp_rank, m.pp_size, microbatches, local)
        if m.dp_size > 1:
            grads = sum(p.numel() * p.element_size() for p in self.module.parameters())
            sent += ring_all_reduce_bytes(m.dp_size, grads) + ring_all_reduce_bytes(m.dp_size, 8)
        shape = tp_theory.LMShape(**lm_shape(ctx.module))
        seq = ctx.sample[0].shape[-1]
        once = tp_theory.tp_collectives(shape, local // microbatches, seq, t, sp,
                                        layers=range(layers[0], layers[1] + 1))
        plan = (once + tp_theory.recomputed_collectives(
            once, self._recomputed(ctx, shape, layers))) * microbatches
        if sp and t > 1:
            numel = sum(p.numel() for p in self._sp_params)
            plan.append(tp_theory.Collective("all_reduce", numel, 4, "sequence-parallel grads"))
        tp_comm, algorithm = m.tp, self.mesh_settings.algorithm
        price = None if tp_comm is None else (
            lambda op, nbytes: tp_comm.theory_bytes_sent(op, nbytes, algorithm))
        return sent + tp_theory.bytes_sent(plan, t, m.tp_rank, price)

    @staticmethod
    def _recomputed(ctx: BuildContext, shape: tp_theory.LMShape, layers: tuple[int, int]
                    ) -> list[int]:
        """This stage's blocks (1..L) that --activation-checkpointing wraps: it picks among
        the stage's own blocks, in order (train/blocks.py)."""
        from disttrain.train.blocks import checkpointed

        mine = [b for b in range(1, shape.n_layers + 1) if layers[0] <= b <= layers[1]]
        return [mine[i] for i in checkpointed(ctx.config.activation_checkpointing, len(mine))]

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        out = super().extras(warmup_steps)
        out.update({"tp_size": self.mesh.tp_size,
                    "sequence_parallel": self.mesh_settings.sequence_parallel})
        return out  # activations: the stage's own count (peak_activation_bytes)

    def trained_module(self) -> nn.Module:
        """This stage's layers, unsplit (gathered over tp), named as in the whole model."""
        if self.shard is None:
            return self.module
        full = TransformerLM(**lm_shape(self.shard))
        placed_like(full, self.shard)
        stage = nn.Sequential(OrderedDict((name, full[int(name)])
                                          for name in self.module._modules))
        stage.load_state_dict(full_state_dict(self.module, self.shard.group))
        return stage

