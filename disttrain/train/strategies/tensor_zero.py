"""ZeRO over the data-parallel groups of a tensor-parallel mesh: ``3d --zero 1|2|3``.

Each tp rank's shard of the TransformerLM is one model to ZeRO, sharded over its dp group
(the ranks holding the same tp slice): ZeRO-1 shards its optimizer state, ZeRO-2 its
gradients too, ZeRO-3 its parameters too (data-parallel sharding of the tensor-parallel
shards, as FSDP2 over a 2-D mesh)::

    tp rank 0 of dp 0 ─┐  ZeRO over dp: the halves of tp rank 0's slices
    tp rank 0 of dp 1 ─┘
    tp rank 1 of dp 0 ─┐  the halves of tp rank 1's slices
    tp rank 1 of dp 1 ─┘

Every tp rank's shard has the same parameter shapes, so the flat layouts (stage 2's
buckets, stage 3's units) agree across tp: element k of a dp rank's gradient shard is the
same element of the same parameter on every tp rank.

**Sequence parallelism.** The replicated parameters of the sequence-split regions
(LayerNorms, row-parallel biases, the position table) get partial gradients on each tp rank,
to be summed over tp. Without ZeRO the sum runs on the whole gradients after backward;
ZeRO-2 and 3 drop each gradient once it is reduce-scattered over dp, so the sum moves to the
reduced shards. Averaging over dp and summing over tp commute, and the layouts agree across
tp, so each rank sums just the sequence-parallel elements of its own shard, in one flat
all-reduce over tp, in ``step()`` before the update (:class:`ShardSequenceParallel`, a
gradient-shard hook of the wrapper): 1/dp of the bytes of the sum on whole gradients, for
every stage.

**ZeRO-3's units** are the shard's layers (the embeddings, each block, the final norm, the
head), FSDP's per-block wrapping: each is gathered over dp just before it runs and freed
after. The embeddings must be one unit: they read the position table directly
(``positions.weight[start:end]``), not through its module's forward.

**Bytes per rank per step** (fp32, P the padded flat size of this rank's shard, d = dp):
(d − 1)/d·P·4 per reduce-scatter or all-gather, as for ZeRO on one model (stage 1: one
of each per step; stage 2: a reduce-scatter per micro-batch and one all-gather; stage 3:
a reduce-scatter and two all-gathers per micro-batch), plus the tensor-parallel
collectives, whose sequence-parallel gradient sum carries this rank's shard's elements of
those parameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import ZeRO1, ZeRO2, ZeroConfig
from disttrain.parallel.tensor.ops import TPGroup
from disttrain.parallel.tensor.transformer import TensorParallelLM, sequence_parallel_parameters
from disttrain.parallel.zero import ZeRO3, ZeroWrapper
from disttrain.train.strategies.base import BuildContext
from disttrain.train.strategies.mesh import MeshSettings


def wrap(ctx: BuildContext, module: nn.Module, dp: Communicator, settings: MeshSettings
         ) -> ZeRO1 | ZeRO2 | ZeRO3:
    """ZeRO stage ``settings.zero`` over ``dp`` around ``module`` (this rank's shard; every
    dp rank built it from the same seed: nothing to broadcast)."""
    config = ZeroConfig(algorithm=settings.algorithm, broadcast_from_rank0=False)
    groups = ctx.param_groups(module)
    if settings.zero == 3:
        return ZeRO3(module, dp, ctx.make_optimizer, config, units=layer_units(module),
                     param_groups=groups)
    kind = ZeRO1 if settings.zero == 1 else ZeRO2
    return kind(module, dp, ctx.make_optimizer, config, param_groups=groups)


def layer_units(module: nn.Module) -> list[nn.Module] | None:
    """ZeRO-3's units for a tensor-parallel TransformerLM: its layers (None, the default
    units, for any other module)."""
    if not isinstance(module, TensorParallelLM):
        return None
    return [layer for layer in module if any(True for _ in layer.parameters())]


def step_bytes(zero: ZeroWrapper, accumulate: int) -> float:
    """ZeRO's bytes per rank per step over dp, counting (d − 1)/d of each padded buffer
    (exact for the ring; the wrapper's own dtypes)."""
    d = zero.comm.world_size
    padded = sum(g.layout.padded_total for g in zero.shard_groups())
    scatter = (d - 1) / d * padded * _element(zero.reduce_dtype)
    gather = (d - 1) / d * padded * _element(zero.param_dtype)
    if zero.stage == 1:
        return scatter + gather
    if zero.stage == 2:
        return scatter * accumulate + gather
    return (scatter + 2 * gather) * accumulate


def _element(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class ShardSequenceParallel:
    """A gradient-shard hook: sums the sequence-parallel parameters' elements of this rank's
    reduced gradient shards over the tp group (see the module doc)."""

    def __init__(self, zero: ZeroWrapper, module: nn.Module, group: TPGroup) -> None:
        names = {id(p): n for n, p in module.named_parameters()}
        wanted = {names[id(p)] for p in sequence_parallel_parameters(module)}
        self.group = group
        self.masters = [g.master for g in zero.shard_groups()]
        self.ranges = [[(pc.shard_offset, pc.length) for pc in g.layout.pieces[zero.comm.rank]
                        if g.names[pc.param] in wanted] for g in zero.shard_groups()]
        self.numel = sum(length for ranges in self.ranges for _, length in ranges)

    def __call__(self, grads: list[torch.Tensor | None]) -> None:
        if not self.numel:  # no such element in this rank's shards (nor in its tp peers')
            return
        for i, ranges in enumerate(self.ranges):
            if ranges and grads[i] is None:  # no gradient: zeros, whose sum the peers need
                grads[i] = torch.zeros_like(self.masters[i])
        parts = [grad[start:start + n] for grad, ranges in zip(grads, self.ranges)
                 if grad is not None for start, n in ranges]  # views of the shards
        total = torch.cat(parts)
        self.group.all_reduce(total)
        offset = 0
        for part in parts:
            part.copy_(total[offset:offset + part.numel()])
            offset += part.numel()

    def element_size(self) -> int:
        return self.masters[0].element_size() if self.masters else 4


def gathered_state(zero: Any, shard: TensorParallelLM) -> dict[str, torch.Tensor]:
    """The unsplit model's state dict: under ZeRO-3 each tp shard is first gathered over dp
    (every parameter full on this rank for the moment), then over tp (both collectives)."""
    from disttrain.parallel.tensor import full_state_dict

    if isinstance(zero, ZeRO3):
        with zero.gathered():
            return full_state_dict(shard, shard.group)
    return full_state_dict(shard, shard.group)
