"""Hugging Face GPT-2 and Llama under the mesh strategies: ``tp``, ``tp-sp`` and ``3d``.

The composer splits a transformers model with :func:`~disttrain.parallel.tensor.parallelize`
and the model's built-in plan (:mod:`disttrain.parallel.tensor.plans`), which returns the
shard and what training it needs (:class:`~disttrain.parallel.tensor.Parallelized`). The
strategies here are the TransformerLM's (:mod:`.tensor`, :mod:`.tensor_pipeline`) on that
shard; what differs:

* **the loss**: the model's own when a dict batch gave it labels (the plan computes it
  from the split logits), else the vocabulary-parallel cross-entropy of the logits against
  the aligned targets (``-100`` ignored): the same value in both cases;
* **sequence parallelism**: the norms' (and GPT-2's row biases') gradients are summed over
  tp before every update (a step pre-hook on the optimizer);
* **pipelines** (tp × pp): the shard is cut as a chain of stage functions
  (:func:`~disttrain.parallel.pipeline.hf.hf_stages`), GPT-2's tied head kept equal to its
  embedding by :class:`~disttrain.parallel.pipeline.hf.TiedWeights` (the pipeline strategy's);
* **the trained model**: a model built from the same config, loaded with the shards joined;
* **bytes per step** (:func:`hf_collectives`): the collectives the plan runs, counted per
  link of the chain. Without sequence parallelism they are the TransformerLM's (one
  all-reduce per f and g); with it, the model's own code needs the whole sequence around
  its blocks: the embedding all-reduces it, the first block's input is split (its gradient
  all-gathered back), GPT-2 joins the sequence after ``ln_f`` (its head's f all-reduces),
  Llama's head gathers it (ḡ). ZeRO over dp inside the mesh gives no theory here.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.mesh import DeviceMesh
from disttrain.parallel.pipeline.hf import hf_stages, is_hf_causal_lm
from disttrain.parallel.tensor import Parallelized, full_state_dict
from disttrain.parallel.tensor import theory as tp_theory
from disttrain.train.batches import logits_of, own_loss
from disttrain.train.config import TrainConfig
from disttrain.train.strategies.base import (
    BuildContext,
    param_bytes,
    placed_like,
    ring_all_reduce_bytes,
)
from disttrain.train.strategies.mesh import MeshSettings
from disttrain.train.strategies.pipeline import activation_sizes, pipeline_theory, stage_layers
from disttrain.train.strategies.tensor import TensorParallelStrategy
from disttrain.train.strategies.tensor_pipeline import TensorPipelineStrategy

Collective = tp_theory.Collective


def pipeline_view(model: nn.Module) -> nn.Module:
    """What a pipeline cuts: a Hugging Face causal LM's chain of stage functions, or the
    model itself (an ``nn.Sequential``, or a model with ``layers()``)."""
    return hf_stages(model) if is_hf_causal_lm(model) else model


def link_kinds(config: Any) -> list[str]:
    """The kind of each link of :func:`~disttrain.parallel.pipeline.hf.hf_stages`' chain."""
    layers = int(config.num_hidden_layers)
    embedding = ["embed", "positions"] if config.model_type == "gpt2" else ["embed"]
    return [*embedding, *["block"] * layers, "norm", "head"]


def hf_collectives(config: Any, batch: int, seq: int, tp: int, sequence_parallel: bool,
                   held: range | None = None) -> list[Collective]:
    """The tensor-parallel collectives of one forward and backward of ``batch`` sequences
    of ``seq`` tokens through the links ``held`` (all: None) of a GPT-2 or Llama shard
    (module docstring; the sequence-parallel gradient sum is per step, not here)."""
    if tp <= 1:
        return []
    act, tokens = batch * seq * int(config.hidden_size), batch * seq

    def c(op: str, where: str, numel: int = act) -> Collective:
        return Collective(op, numel, 4, where)

    sp, out = sequence_parallel, []
    kinds = link_kinds(config)
    first_block = kinds.index("block")
    for index, kind in enumerate(kinds):
        if held is not None and index not in held:
            continue
        if kind == "embed":
            out.append(c("all_reduce", "embedding (g)"))
        elif kind == "block":
            pair = [c("all_gather", "f"), c("reduce_scatter", "g")] if sp else [
                c("all_reduce", "g or f")]  # 2 f and 2 g, each one way forward, one back
            out += pair * 4 + ([c("all_gather", "split backward")]
                               if sp and index == first_block else [])
        elif kind == "norm" and sp and config.model_type == "gpt2":
            out.append(c("all_gather", "join after ln_f"))
        elif kind == "head":
            if sp and config.model_type != "gpt2":
                out += [c("all_gather", "head (ḡ)"), c("reduce_scatter", "head backward")]
            else:
                out.append(c("all_reduce", "head (f) backward"))
            out += [c("all_reduce", "cross-entropy max", tokens),
                    c("all_reduce", "cross-entropy sums", 2 * tokens)]
    return out


def _price(mesh: DeviceMesh, algorithm: str | None) -> Any:
    tp_comm = mesh.tp
    if tp_comm is None:
        return None
    return lambda op, nbytes: tp_comm.theory_bytes_sent(op, nbytes, algorithm)


def _tp_bytes(parallel: Parallelized, within: nn.Module, config: Any, batch: int, seq: int,
              microbatches: int, mesh: DeviceMesh, settings: MeshSettings,
              held: range | None = None) -> float:
    """What this rank sends over tp in one step through the links ``held``."""
    plan = hf_collectives(config, batch, seq, mesh.tp_size, settings.sequence_parallel,
                          held) * microbatches
    numel = sum(p.numel() for p in parallel.sequence_parallel_parameters(within))
    if numel:
        plan.append(Collective("all_reduce", numel, 4, "sequence-parallel gradients"))
    return tp_theory.bytes_sent(plan, mesh.tp_size, mesh.tp_rank,
                                _price(mesh, settings.algorithm))


def _counted(config: TrainConfig) -> bool:
    """Whether the theory below holds: fp32 (mixed precision moves bf16 activations) and no
    activation checkpointing (a recomputed forward runs its collectives again)."""
    return config.precision == "fp32" and config.activation_checkpointing == "none"


def _config_of(model: nn.Module) -> Any:
    """A transformers model's config (its sizes; a shard keeps the whole model's)."""
    return getattr(model, "config")  # noqa: B009  (nn.Module types attributes as tensors)


def _sequence_length(sample: Any) -> int:
    ids = sample["input_ids"] if isinstance(sample, dict) else sample
    return int(ids.shape[-1])


def _unsplit_like(shard: nn.Module) -> nn.Module:
    """A freshly built model of the shard's config, placed like the shard (it then gets
    the shards' joined state)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(_config_of(shard))
    assert isinstance(model, nn.Module)
    return placed_like(model, shard)


class HFTensorParallelStrategy(TensorParallelStrategy):
    """``tp``, ``tp-sp``, ``3d`` with pp = 1 on a Hugging Face model's shard."""

    def __init__(self, ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings,
                 parallel: Parallelized) -> None:
        self.parallel = parallel
        super().__init__(dataclasses.replace(ctx, module=parallel.module), mesh, settings, None)
        self.zero_stage = None  # a tp slice: no ZeRO formula for its model state
        if settings.sequence_parallel:
            if not isinstance(self.optimizer, torch.optim.Optimizer):
                raise ValueError("--zero with sequence parallelism on a Hugging Face model is "
                                 "not supported; drop --sequence-parallel or --zero")
            self.optimizer.register_step_pre_hook(
                lambda *_: parallel.reduce_sequence_parallel_grads())

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        """The model's own loss (labels given), else the vocabulary-parallel one."""
        loss = own_loss(output)
        return loss if loss is not None else self.parallel.loss(logits_of(output), target)

    def predict(self, inputs: Any) -> torch.Tensor | None:
        return self.parallel.full_logits(logits_of(super().predict(inputs)))

    def _theory(self, ctx: BuildContext) -> float | None:
        config = ctx.config
        if not _counted(config) or getattr(self, "zero", None) is not None:
            return None
        micro = config.micro_batch(self.mesh.dp_size)
        sent = _tp_bytes(self.parallel, self.module, _config_of(self.module), micro,
                         _sequence_length(ctx.sample[0]), config.accumulate, self.mesh,
                         self.settings)
        return sent + ring_all_reduce_bytes(self.mesh.dp_size, param_bytes(self.module))

    def trained_module(self) -> nn.Module:
        """The unsplit model (the shards joined over tp: a collective)."""
        full = _unsplit_like(self.module)
        full.load_state_dict(self.parallel.full_state_dict())
        return full


class HFTensorPipelineStrategy(TensorPipelineStrategy):
    """``3d`` with tp > 1 and pp > 1 on a Hugging Face model: its shard as a chain."""

    def __init__(self, ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings,
                 parallel: Parallelized) -> None:
        self.parallel = parallel
        split = mesh.tp_size if settings.sequence_parallel else 1
        chain = hf_stages(parallel.module, sequence_split=split)
        stages = _ShardChain(chain, parallel)
        super().__init__(dataclasses.replace(ctx, module=hf_stages(ctx.module)), mesh,
                         settings, stages)  # type: ignore[arg-type]
        self._sp_params = parallel.sequence_parallel_parameters(self.module)

    def _mesh_theory(self, ctx: BuildContext, microbatches: int) -> float | None:
        if not _counted(ctx.config):
            return None
        m, config = self.mesh, _config_of(self.parallel.module)
        local = ctx.config.global_batch // m.dp_size
        first, last = stage_layers(self.module)
        kinds = link_kinds(config)
        sizes = activation_sizes(ctx.module, ctx.sample[0])
        if self.mesh_settings.sequence_parallel:  # inside the split region: 1/t each
            inside = [i for i, kind in enumerate(kinds) if kind == "block" or (
                kind == "norm" and config.model_type != "gpt2")]
            sizes = [s / m.tp_size if i in inside else s for i, s in enumerate(sizes)]
        sent = pipeline_theory(sizes, (first, last), m.pp_rank, m.pp_size, microbatches,
                               local)
        if m.dp_size > 1:
            sent += ring_all_reduce_bytes(m.dp_size, param_bytes(self.module))
            sent += ring_all_reduce_bytes(m.dp_size, 8)  # the loss, float64
        if self.tied is not None:
            sent += self.tied.theory_bytes()
        return sent + _tp_bytes(self.parallel, self.module, config, local // microbatches,
                                _sequence_length(ctx.sample[0]), microbatches, m,
                                self.mesh_settings, range(first, last + 1))

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        """The TransformerLM's share, the head's copy of a tied weight counted once."""
        from disttrain.train.clipping import squares

        share, comm = super().grad_norm_share()
        if self.tied is not None and self.mesh.dp_rank == 0:
            share = share - squares(self.tied.copies())
        return share, comm

    def trained_module(self) -> nn.Module:
        """This stage's links, unsplit (gathered over tp), under the model's names."""
        from disttrain.parallel.pipeline.hf import named_layers

        chain = hf_stages(_unsplit_like(self.parallel.module))
        keys = list(self.module._modules)  # the links' indices in the chain
        stage = nn.Sequential(OrderedDict((k, chain.chain[int(k)]) for k in keys))
        stage.load_state_dict(full_state_dict(self.module, self.parallel.group))
        return named_layers([chain.names[int(k)] for k in keys], list(stage))


class _ShardChain:
    """A shard's chain of links as :class:`TensorPipelineStrategy` takes its shard: the
    layers to cut, and the vocabulary-parallel loss and group for the last stage."""

    def __init__(self, chain: nn.Module, parallel: Parallelized) -> None:
        self.chain, self.parallel = chain, parallel
        self.group = parallel.group

    def layers(self) -> Sequence[nn.Module]:
        return self.chain.layers()  # type: ignore[operator, no-any-return]

    def layer_names(self) -> list[str]:
        return self.chain.layer_names()  # type: ignore[operator, no-any-return]

    @property
    def tied(self) -> list[tuple[str, str]]:
        return list(getattr(self.chain, "tied", []))

    def loss(self, output: Any, target: torch.Tensor) -> torch.Tensor:
        return self.parallel.loss(logits_of(output), target)
