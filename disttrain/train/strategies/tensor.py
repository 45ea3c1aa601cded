"""Tensor parallelism in the shared loop: ``tp``, ``tp-sp`` and ``3d`` (dp × pp × tp).

Every rank builds the whole TransformerLM (same seed), finds its place in the mesh
(:mod:`disttrain.parallel.mesh`: ``tp`` and ``tp-sp`` put every rank in one tensor-parallel
group, ``3d`` reads ``--dp``, ``--pp``, ``--tp``) and keeps its tensor-parallel shard
(:func:`~disttrain.parallel.tensor.apply_tensor_parallel`). Then, along the other two
dimensions:

* **pp = 1**: the shard trains as one model; across dp replicas ``DataParallel`` averages
  its gradients during backward, or ZeRO-1/2/3 shards its optimizer state (gradients,
  parameters) over the dp group (``--zero``; :mod:`.tensor_zero`);
* **pp > 1**: the pipeline engine cuts the shard's layers into stages; its pp groups carry
  the activations (each tp rank talks to the same tp rank of the next stage: without SP
  every tp rank sends the whole activation, with SP its slice of the sequence) and its dp
  groups average each stage's gradients.

Data: all ranks of one dp replica (its tp ranks and pp stages) read the same shard of the
batch. Loss: the vocabulary-parallel cross-entropy (logits never leave their rank while
training). Sequence parallelism: after backward the gradients of the replicated parameters
of the sequence-split regions are summed over the tp group (under ZeRO: their elements of
the reduced gradient shards, before the update). Evaluation gathers the logits over the tp
group (it scores the full vocabulary).

Bytes per rank per step (``theory_bytes_per_step``, fp32): the TP collectives of this
rank's layers (:func:`~disttrain.parallel.tensor.theory.tp_step_collectives`, exact for
the ring), plus the dp gradient all-reduce (ring, 2(d − 1)/d of the shard's gradients) or
ZeRO's reduce-scatter + all-gather, plus, with pp > 1, the pipeline's messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import DataParallel
from disttrain.parallel.context.api import ContextParallelLM
from disttrain.parallel.mesh import DeviceMesh
from disttrain.parallel.mixed_precision import accumulate, at_least_fp32
from disttrain.parallel.tensor import theory as tp_theory
from disttrain.parallel.tensor.transformer import (
    ParallelBlock,
    TensorParallelLM,
    lm_shape,
    reduce_sequence_parallel_grads,
    sequence_parallel_parameters,
)
from disttrain.parallel.universal import Layout
from disttrain.parallel.zero import ZeRO1, ZeRO2, ZeRO3
from disttrain.train.strategies import tensor_zero
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    Stepper,
    Strategy,
    missing_state,
    param_bytes,
    placed_like,
    ring_all_reduce_bytes,
    safe_load,
    writes_once,
)
from disttrain.train.strategies.mesh import MeshSettings
from disttrain.train.transformer import TransformerLM


class ActivationProbe:
    """What autograd saves in the first training forward of one block (parameters left
    out, each storage once), and, for disttrain's blocks (``formula``: inputs ``(T, B, H)``,
    or ``(T/t, B, H)`` with sequence parallelism), the formula's figure for that input."""

    def __init__(self, block: nn.Module, tp: int, sequence_parallel: bool,
                 formula: bool = True) -> None:
        self.tp, self.sequence_parallel, self.with_formula = tp, sequence_parallel, formula
        self.measured: int | None = None
        self.formula: int | None = None
        self._params: set[int] = set()  # read at forward: ZeRO-3 gathers them just before
        self._seen: dict[int, int] = {}
        self._context: Any = None
        self._handles = [block.register_forward_pre_hook(self._start),
                         block.register_forward_hook(self._stop)]
        self._block = block

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in self._params:
            self._seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def _start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or not module.training:
            return
        x = args[0]
        self._params = {_storage(p).data_ptr() for p in self._block.parameters()}
        if self.with_formula:
            length = x.shape[0] * (self.tp if self.sequence_parallel else 1)
            attention: Any = self._block.attention
            self.formula = tp_theory.block_activation_bytes(
                length, x.shape[1], x.shape[2], attention.n_heads * self.tp, self.tp,
                self.sequence_parallel, x.element_size())
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._context.__enter__()

    def _stop(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self._context is None:
            return
        self._context.__exit__(None, None, None)
        self.measured = sum(self._seen.values())
        self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def extras(self) -> dict[str, Any]:
        return {"activation_bytes_per_block": self.measured,
                "activation_bytes_per_block_formula": self.formula}


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding ``t``'s elements on this rank (a DTensor's: its local shard's;
    torch's baselines save DTensors)."""
    local = getattr(t, "_local_tensor", t)
    return local.untyped_storage()


def probe_first_block(module: nn.Module, tp: int, sp: bool) -> ActivationProbe | None:
    block = next((m for m in module.modules() if isinstance(m, ParallelBlock)), None)
    return ActivationProbe(block, tp, sp) if block is not None else None


class TensorParallelStrategy(Strategy):
    """This rank's TP shard (pp = 1), data-parallel over the mesh's dp group."""

    collective_eval = True  # forward runs TP collectives: every rank scores alike

    def __init__(self, ctx: BuildContext, mesh: DeviceMesh, settings: MeshSettings,
                 shard: TensorParallelLM | None) -> None:
        self.mesh, self.settings = mesh, settings
        self.checkpointing = ctx.config.activation_checkpointing  # the loop applies it
        module: nn.Module = shard if shard is not None else ctx.module
        self.shard = shard
        self.zero: ZeRO1 | ZeRO2 | ZeRO3 | None = None
        self.cp = context_parallel(module, mesh, settings)  # forward over cp's sequence
        model: nn.Module = self.cp if self.cp is not None else module
        optimizer = None
        stepper: Stepper
        self.sp_shards: tensor_zero.ShardSequenceParallel | None = None
        if settings.zero and mesh.dp is not None:
            self.zero = tensor_zero.wrap(ctx, module, mesh.dp, settings)
            if isinstance(self.zero, ZeRO3):  # forward gathers each layer over dp
                model = self.zero
            if shard is not None and settings.sequence_parallel:
                self.sp_shards = tensor_zero.ShardSequenceParallel(self.zero, module,
                                                                   shard.group)
                self.zero.register_grad_shard_hook(self.sp_shards)
            stepper = self.zero
        else:
            if mesh.dp is not None:
                model = DataParallel(model, mesh.dp, algorithm=settings.algorithm)
            optimizer = ctx.make_optimizer(module.parameters())
            stepper = optimizer
        super().__init__(module, stepper, ctx.comm, model)
        self._sp_params = sequence_parallel_parameters(module) if settings.sequence_parallel \
            and shard is not None and self.zero is None else []  # ZeRO: on its shards
        self.probe = probe_first_block(module, mesh.tp_size, settings.sequence_parallel)
        if shard is None:  # cp alone: the whole model on every rank, as DDP or ZeRO-1 keeps it
            self.zero_stage = settings.zero or 0
        self.theory_bytes_per_step = self._theory(ctx)

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        """Split parameters on every tp rank, replicated ones on tp rank 0, all on replica
        0 (under ZeRO: on every dp rank, from its disjoint gradient shards); summed over
        the mesh."""
        from disttrain.train.clipping import tp_shard_share, tp_share

        share = tp_share(self.module, self.mesh) if self.zero is None else (
            tp_shard_share(self.zero, self.module, self.mesh.tp_rank))
        # cp ranks hold the same gradients: once
        return (share if self.mesh.cp_rank == 0 else torch.zeros_like(share)), self.mesh.world

    def update_optimizer(self) -> torch.optim.Optimizer | None:
        """Under ZeRO, the optimizer of this rank's shards (fp16's scaler and clipping act
        there, between the reductions and the update)."""
        return self.zero.optimizer if self.zero is not None else super().update_optimizer()

    # ------------------------------------------------------------------ data
    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    # ------------------------------------------------------------------ training
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.cp is not None:  # this rank's share of the whole sequence's loss
            return self.cp.loss(output, target)
        if self.shard is not None:
            return self.shard.loss(output, target)
        return F.cross_entropy(at_least_fp32(output.flatten(0, -2)), target.flatten())

    def no_sync(self) -> AbstractContextManager[Any]:
        if self.zero is not None:
            return self.zero.no_sync()
        sync = getattr(self.model, "no_sync", None)
        return sync() if sync is not None else nullcontext()

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        """The base step with the vocabulary-parallel loss, and the sequence-parallel
        gradients summed over tp before the update."""
        self.model.train()
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            inputs, targets = self._split(inputs), self._split(targets)
            with self.no_sync() if i < last else nullcontext():
                with self.phase("forward"), autocast():
                    loss = self.loss(self.model(inputs), targets) / len(micro_batches)
                with self.phase("backward"):
                    (loss if self.scaler is None else self.scaler.scale(loss)).backward()
            total = accumulate(total, loss)
        if self.shard is not None:  # (under ZeRO its hook sums them on the shards)
            reduce_sequence_parallel_grads(self._sp_params, self.shard.group)
        if self.cp is not None:
            self.cp.reduce_context_parallel_grads()
        with self.phase("optimizer"):
            self.optimizer.step()
        assert total is not None  # the loop passes at least one micro-batch
        # with cp: the mean loss of this rank's tokens (its share is 1/cp of the sequence's)
        return total * self.mesh.cp_size if self.cp is not None else total

    def _split(self, batch: torch.Tensor) -> torch.Tensor:
        """This cp rank's tokens of ``batch`` (the zig-zag split), or all of them."""
        if self.cp is None:
            return batch
        from disttrain.parallel.context import split_sequence

        return split_sequence(batch, self.mesh.cp_rank, self.mesh.cp_size)

    # ------------------------------------------------------------------ evaluation
    def predict(self, inputs: Any) -> torch.Tensor | None:
        if self.cp is not None:  # every cp rank's logits, in sequence order
            output = self.cp.gather_sequence(self.cp(self._split(inputs)), dim=1)
        else:  # ZeRO-3's wrapper gathers each layer; otherwise the module, without DDP
            output = (self.zero if isinstance(self.zero, ZeRO3) else self.module)(inputs)
        return self.shard.full_logits(output) if self.shard is not None else output

    def block_module(self) -> nn.Module:
        return self.cp if self.cp is not None else self.module

    def eval_modules(self) -> list[nn.Module]:
        return [self.module] if self.cp is None else [self.module, self.cp]

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        """Every tp rank scored the same replica's shard: sum over the dp group only."""
        if self.mesh.dp is not None:
            self.mesh.dp.all_reduce(totals)
        return totals

    # ------------------------------------------------------------------ checkpoints
    def _state_file(self, path: str) -> str:  # the format before the universal one
        return os.path.join(path, f"state-tp{self.mesh.tp_rank:05d}-of-{self.mesh.tp_size:05d}"
                                  f".pt")

    def checkpoint_layout(self) -> Layout:
        """This rank's tp slices (under ZeRO: its shard's pieces of them), each written by
        one rank: the first dp and cp replica, and of a tp group, tp rank 0 alone for what
        every tp rank holds whole."""
        from disttrain.parallel import universal
        from disttrain.parallel.zero import checkpoint

        mesh, optimizer = self.mesh, self.update_optimizer()
        splits = universal.tensor_parallel_splits(self.module, mesh.tp_rank, mesh.tp_size)
        if self.zero is not None:  # dp: ZeRO's pieces, each written by its own rank
            return checkpoint.layout(self.zero, splits, writes_once(mesh.cp_rank == 0,
                                                                    mesh.tp_rank))
        return universal.module_layout(
            self.module.named_parameters(), optimizer,
            buffers=universal.persistent_buffers(self.module), splits=splits,
            writes=writes_once(mesh.dp_rank == 0 and mesh.cp_rank == 0, mesh.tp_rank),
            model_config=universal.model_config(self.module))

    def load_state(self, path: str, rank: int) -> None:
        """The universal checkpoint, written under any strategy; or this rank's
        ``state-tp*`` file (the format before it, which needs the same tp)."""
        from disttrain.parallel import universal
        from disttrain.parallel.zero import checkpoint

        directory = os.path.join(path, universal.DIRECTORY)
        if universal.is_universal(directory) and self.zero is not None:
            splits = universal.tensor_parallel_splits(self.module, self.mesh.tp_rank,
                                                      self.mesh.tp_size)
            checkpoint.read_into(self.zero, directory, splits=splits)
            return
        if universal.is_universal(directory):
            universal.load(directory, self.checkpoint_layout())
            return
        file = self._state_file(path)
        if not os.path.exists(file):
            raise missing_state(path, f"{os.path.basename(file)} (tp rank {self.mesh.tp_rank} "
                                      f"of {self.mesh.tp_size})")
        self.load_state_dict(safe_load(file))

    # ------------------------------------------------------------------ measurements
    def _theory(self, ctx: BuildContext) -> float | None:
        config = ctx.config
        if config.precision != "fp32":
            return None  # mixed precision: bf16 activations, fp32 gradients of f
        micro, seq = config.micro_batch(self.mesh.dp_size), ctx.sample[0].shape[-1]
        shape = tp_theory.LMShape(**lm_shape(ctx.module))
        cp = self.mesh.cp_size  # tp's collectives carry this rank's seq / cp tokens
        sent = float(tp_theory.bytes_sent(
            self._tp_collectives(shape, micro, seq // cp, config.accumulate),
            self.mesh.tp_size, self.mesh.tp_rank, self._tp_price()))
        if self.cp is not None:
            cp_sent = self._cp_theory(shape, micro, seq, config.accumulate)
            if cp_sent is None:
                return None
            sent += cp_sent
        if self.zero is not None:
            sent += tensor_zero.step_bytes(self.zero, config.accumulate)
        else:
            sent += ring_all_reduce_bytes(self.mesh.dp_size, param_bytes(self.module))
        return sent

    def _tp_collectives(self, shape: tp_theory.LMShape, batch: int, seq: int,
                        microbatches: int) -> list[tp_theory.Collective]:
        """The tp collectives of one step; under ZeRO with SP, the sequence-parallel
        gradient sum carries this rank's shard's elements of them (:mod:`.tensor_zero`)."""
        from disttrain.train.blocks import checkpointed

        tp, sp = self.mesh.tp_size, self.settings.sequence_parallel
        # checkpointed blocks run their forward, and its collectives, again in backward
        again = [i + 1 for i in checkpointed(self.checkpointing, shape.n_layers)]
        out = tp_theory.tp_step_collectives(shape, batch, seq, tp, sp, microbatches,
                                            recomputed=again)
        if self.sp_shards is None:
            return out
        out = [c for c in out if c.where != "sequence-parallel gradients"]
        if self.sp_shards.numel:
            out.append(tp_theory.Collective("all_reduce", self.sp_shards.numel,
                                            self.sp_shards.element_size(),
                                            "sequence-parallel gradient shards"))
        return out

    def _cp_theory(self, shape: tp_theory.LMShape, micro: int, seq: int, accumulate: int
                   ) -> float | None:
        """Context parallelism's bytes per step on the cp group: attention for every
        micro-batch (exact for the ring and the pairwise all-to-all) and the gradients'
        all-reduce (the communicator's price for its algorithm; None: not observable)."""
        from disttrain.parallel.context.theory import (
            attention_bytes_sent,
            attention_forward_bytes,
        )
        from disttrain.train.blocks import checkpointed

        cp_comm, element = self.mesh.cp, next(self.module.parameters()).element_size()
        sizes = (self.settings.cp_variant, cp_comm.world_size, micro, seq,
                 shape.d_model // self.mesh.tp_size)
        attention = attention_bytes_sent(*sizes, shape.n_layers, element)
        # a checkpointed block's attention forward runs again in backward
        again = len(checkpointed(self.checkpointing, shape.n_layers))
        attention += attention_forward_bytes(*sizes, again, element)
        grads = cp_comm.theory_bytes_sent("all_reduce", param_bytes(self.module),
                                          self.settings.algorithm)
        if grads is None:
            return None
        if self.settings.algorithm == "ring":  # exact for this rank's segments
            from disttrain.parallel.context.theory import ring_all_reduce_bytes as exact

            grads = exact(sum(p.numel() for p in self.module.parameters()),
                          cp_comm.world_size, cp_comm.rank, element)
        return accumulate * attention + grads

    def _tp_price(self) -> Callable[[str, int], float | None] | None:
        """The bytes of one tp collective with the algorithm the tp group runs it with."""
        tp_comm, algorithm = self.mesh.tp, self.settings.algorithm
        if tp_comm is None:
            return None
        return lambda op, nbytes: tp_comm.theory_bytes_sent(op, nbytes, algorithm)

    def communicators(self) -> list[Communicator]:
        return self.mesh.communicators()

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        out: dict[str, Any] = {"dp_size": self.mesh.dp_size, "pp_size": 1,
                               "tp_size": self.mesh.tp_size, "cp_size": self.mesh.cp_size,
                               "cp_variant": self.settings.cp_variant,
                               "sequence_parallel": self.settings.sequence_parallel,
                               "zero_stage": self.settings.zero}
        if self.probe is not None:
            out.update(self.probe.extras())
        if self.zero is not None:  # ZeRO's formula for this rank's shard of the tp slice
            from disttrain.parallel.zero import zero_formula, zero_measured

            out["model_state_bytes"] = zero_measured(self.zero).as_dict()
            out["model_state_bytes_formula"] = zero_formula(self.zero).as_dict()
        return out

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Under ZeRO, what its wrapper keeps (shards, flat buffers, optimizer state)."""
        return self.zero.model_state_tensors() if self.zero is not None else (
            super().model_state_tensors())

    def trained_module(self) -> nn.Module:
        """The unsplit TransformerLM (its shards gathered over tp, under ZeRO-3 over dp
        first: collectives)."""
        if self.shard is None:
            return self.module
        full = placed_like(TransformerLM(**lm_shape(self.shard)), self.shard)
        full.load_state_dict(tensor_zero.gathered_state(self.zero, self.shard))
        return full

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        remove = getattr(self.zero, "remove_hooks", None)
        if remove is not None:
            remove()


def context_parallel(module: nn.Module, mesh: DeviceMesh, settings: MeshSettings
                     ) -> ContextParallelLM | None:
    """``module`` (the TransformerLM or its tp shard) over the mesh's cp group, or None
    without one (collective over cp: the ring connects its neighbours here)."""
    if mesh.cp is None:
        return None
    from disttrain.parallel.context import apply_context_parallel

    return apply_context_parallel(module, mesh.cp, settings.cp_variant,
                                  algorithm=settings.algorithm, all_to_all_algorithm="naive")
