"""PyTorch's own tensor parallelism on the same model, as a baseline: ``torch-tp`` and
``torch-tp-sp``.

``torch.distributed.tensor.parallel.parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` (and ``SequenceParallel`` for the norms with ``torch-tp-sp``) on a
``DeviceMesh`` of the module's device type over the communicator's group, the plan
torchtitan applies to Llama.
It is torch's code, so it calls torch.distributed directly and its traffic bypasses
disttrain.comm (``counts_bytes = False``).

Two adaptations, both exact rewrites of the same function:

* torch's ``ColwiseParallel`` splits a weight into contiguous row blocks, so the fused QKV
  projection (rows Q | K | V) would give rank 0 all of Q and half of K. The baseline's
  attention has separate Q, K and V projections (torchtitan's layout), initialised from
  the fused one's thirds, and counts its heads from the local width.
* With sequence parallelism, torch's embedding reduce-scatter would leave the learned
  position embedding nothing to add to: the baseline all-reduces the token embedding, adds
  the positions, then lets the first block take its slice of the sequence (Megatron-LM's
  order with learned positions; ``PrepareModuleInput`` with ``Replicate`` → ``Shard(1)``).

The loss is ``loss_parallel``: cross-entropy on the vocabulary-sharded logits, as in
disttrain's ``tp``.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.baselines.torch_data_parallel import mesh_device_type, native_group
from disttrain.parallel.mixed_precision import accumulate, at_least_fp32
from disttrain.parallel.tensor.transformer import lm_shape
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    Strategy,
    placed_like,
)
from disttrain.train.strategies.tensor import ActivationProbe
from disttrain.train.transformer import CausalSelfAttention, TransformerLM


class SplitQKVAttention(nn.Module):
    """``CausalSelfAttention`` with separate Q, K, V projections (same function)."""

    def __init__(self, fused: CausalSelfAttention) -> None:
        super().__init__()
        d_model = fused.out.in_features
        self.head_dim = d_model // fused.n_heads
        weight = fused.qkv.weight
        self.q, self.k, self.v = (nn.Linear(d_model, d_model, device=weight.device,
                                            dtype=weight.dtype) for _ in range(3))
        with torch.no_grad():
            for proj, w, b in zip((self.q, self.k, self.v), fused.qkv.weight.chunk(3),
                                  fused.qkv.bias.chunk(3)):
                proj.weight.copy_(w)
                proj.bias.copy_(b)
        self.out = copy.deepcopy(fused.out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length = x.shape[0], x.shape[1]
        q, k, v = (proj(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))  # heads: this rank's
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, -1))


def split_qkv(model: TransformerLM) -> nn.Sequential:
    """A copy of ``model`` whose attention layers have separate Q, K, V projections."""
    out = copy.deepcopy(model)
    blocks: list[Any] = list(out)[1:-2]
    for block in blocks:
        block.attention = SplitQKVAttention(block.attention)
    return out


def plan(model: nn.Sequential, sequence_parallel: bool) -> dict[str, Any]:
    """torchtitan's plan for this model's layer names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    last = len(model) - 1
    sp = sequence_parallel
    def rows() -> Any:  # row-parallel output: reduce-scattered with SP, else all-reduced
        return RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel()

    out: dict[str, Any] = {
        "0.tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        str(last): ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                   output_layouts=Shard(-1), use_local_output=False)}
    for i in range(1, last - 1):
        out.update({f"{i}.attention.{p}": ColwiseParallel() for p in "qkv"})
        out.update({f"{i}.attention.out": rows(), f"{i}.mlp.0": ColwiseParallel(),
                    f"{i}.mlp.2": rows()})
        if sp:
            out.update({
                f"{i}.norm1": SequenceParallel(), f"{i}.norm2": SequenceParallel(),
                f"{i}.attention": PrepareModuleInput(input_layouts=(Shard(1),),
                                                     desired_input_layouts=(Replicate(),)),
                f"{i}.mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),))})
    if sp:
        out["1"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                      desired_input_layouts=(Shard(1),), use_local_output=True)
        out[str(last - 1)] = SequenceParallel()
    return out


class TorchTensorParallelStrategy(Strategy):
    """torch's tensor parallelism: parameters are DTensors; its traffic is not counted."""

    counts_bytes = False
    collective_eval = True

    def __init__(self, ctx: BuildContext, sequence_parallel: bool) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import parallelize_module

        name = ctx.config.strategy
        comm = ctx.require_comm(name)
        if not isinstance(ctx.module, TransformerLM):
            raise ValueError(f"strategy {name!r} splits disttrain's TransformerLM; use --model "
                             f"transformer")
        self.device_mesh = DeviceMesh.from_group(native_group(comm, name),
                                                 mesh_device_type(ctx, comm, name))
        self.shape = lm_shape(ctx.module)  # to rebuild the unsplit model at the end
        model = parallelize_module(split_qkv(ctx.module), self.device_mesh,
                                   plan(ctx.module, sequence_parallel))
        super().__init__(model, ctx.make_optimizer(model.parameters()), comm)
        self.sequence_parallel = sequence_parallel
        self.probe = ActivationProbe(model.get_submodule("1"), comm.world_size, sequence_parallel,
                                     formula=False)

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        from torch.distributed.tensor.parallel import loss_parallel

        self.model.train()
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None
        for inputs, targets in micro_batches:
            with loss_parallel():
                with self.phase("forward"), autocast():
                    logits = self.model(inputs)
                    loss = F.cross_entropy(at_least_fp32(logits.flatten(0, 1)),
                                           targets.flatten()) / len(micro_batches)
                with self.phase("backward"):
                    loss.backward()
            total = accumulate(total, _local(loss.detach()))
        with self.phase("optimizer"):
            self.optimizer.step()
        assert total is not None  # the loop passes at least one micro-batch
        return total

    @property
    def dp_rank(self) -> int:
        return 0  # one replica: every rank reads the same data

    @property
    def dp_size(self) -> int:
        return 1

    def predict(self, inputs: Any) -> torch.Tensor | None:
        return _local(self.model(inputs))

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        return totals  # one replica: every rank scored the whole split

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        return {"dp_size": 1, "pp_size": 1, "tp_size": self.device_mesh.size(),
                "sequence_parallel": self.sequence_parallel, **self.probe.extras()}

    def trained_module(self) -> nn.Module:
        """The unsplit TransformerLM (DTensors gathered: a collective)."""
        state = {k: _local(v) for k, v in self.model.state_dict().items()}
        for key in [k for k in state if ".attention.q." in k]:
            prefix, leaf = key.split(".attention.q.")
            state[f"{prefix}.attention.qkv.{leaf}"] = torch.cat(
                [state.pop(f"{prefix}.attention.{p}.{leaf}") for p in "qkv"])
        full = placed_like(TransformerLM(**self.shape), self.module)
        full.load_state_dict(state)
        return full

    def close(self) -> None:
        self.probe.close()
        self.optimizer = None
        gc.collect()


def _local(t: Any) -> torch.Tensor:
    """A DTensor's full value (a collective), or the plain tensor itself."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t  # type: ignore[no-any-return]


def build_torch_tp(ctx: BuildContext) -> Strategy:
    sp = ctx.config.parallel.sequence_parallel or ctx.config.strategy.endswith("-sp")
    return TorchTensorParallelStrategy(ctx, sp)
