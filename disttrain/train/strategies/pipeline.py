"""Model and pipeline parallelism in the shared loop: ``model-parallel``, ``gpipe``, ``1f1b``.

Every rank builds the whole model (same seed), keeps its stage's layers, and trains them
with its own optimizer (a stage with no parameters, e.g. only ReLU and Flatten, has none).
Forward and backward are interleaved by the schedule, so the step is ``pipe.train_step``:
it returns the batch's loss on every rank and leaves gradients in ``.grad``.

Data: all stages of one pipeline must see the same batch (stage 0 its inputs, the last
stage its targets), so the sampler shards by the pipeline replica (``mesh.dp_rank`` of
``mesh.dp_size``), not by rank. Evaluation runs ``eval_forward`` (the last stage gets the
output) and ``share_from_last`` gives its scores to every rank.

Bytes per rank per step (what :func:`pipeline_theory` computes, exact): stage s < p−1 sends
the activations at its output boundary, B·a_out bytes for a local batch of B samples, and
stage s > 0 sends the same-sized gradients back at its input boundary, B·a_in, each of the
m micro-batches with a 128-byte header; in a pp × dp grid each stage also all-reduces its
gradients (and the loss) over its dp group. With ``--virtual-stages v`` (interleaved 1F1B)
each of a rank's v chunks is such a stage among p·v (:func:`stage_theory`): v times the
messages, each at its own chunk's boundaries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.checkpoint_files import load as safe_load
from disttrain.parallel.pipeline.wire import HEADER_BYTES  # in front of every message
from disttrain.parallel.universal import Layout, Split
from disttrain.train.precision import autocast_factory
from disttrain.train.strategies.base import (
    Autocast,
    Batch,
    BuildContext,
    LossFn,
    Strategy,
    missing_state,
    ring_all_reduce_bytes,
    writes_once,
)

DEFAULT_MICROBATCHES = 8


def activation_sizes(module: nn.Module, sample: Any, autocast: Autocast = nullcontext,
                     rows: int = 1) -> list[float]:
    """Bytes per sample of each layer's output as a message, measured on ``rows`` samples
    (a micro-batch: a tuple or dict output travels as a bundle whose manifest does not grow
    with the rows; forward only, in eval mode, so no running statistic changes)."""
    from disttrain.parallel.pipeline import bundle, layers_of

    was_training = module.training
    module.eval()
    sizes = []
    try:
        x = bundle.split(sample, max(1, bundle.rows_of(sample) // max(rows, 1)))[0]
        rows = max(bundle.rows_of(x), 1)
        with torch.no_grad(), autocast():
            for layer in layers_of(module):
                x = layer(x)
                if bundle.is_tensor(x):
                    sizes.append(x.numel() * x.element_size() / rows)
                else:
                    sizes.append(bundle.pack(*bundle.leaves(x, "an output")).numel() / rows)
    finally:
        module.train(was_training)
    return sizes


def stage_layers(module: nn.Module) -> tuple[int, int]:
    """First and last layer index of a stage module (its children are named by index)."""
    names = [int(name) for name in module._modules]
    return (names[0], names[-1]) if names else (0, -1)


def held_layers(pipe: Any) -> list[int]:
    """First and last layer index of each of the stage's chunks, one after the other
    (``[first, last]`` without virtual stages): what a checkpoint file says it holds."""
    chunks = getattr(pipe, "chunks", None) or [pipe.module]
    return [index for chunk in chunks for index in stage_layers(chunk)]


def stage_theory(sizes: Sequence[float], held: Sequence[int], stage: int, pp: int,
                 microbatches: int, local_batch: int) -> float:
    """Bytes stage ``stage`` of ``pp`` sends in one step: :func:`pipeline_theory` for each
    of its chunks (``held``: :func:`held_layers`), chunk c being stage c·pp + ``stage`` of
    pp·v."""
    v = len(held) // 2
    return sum(pipeline_theory(sizes, (held[2 * c], held[2 * c + 1]), c * pp + stage, pp * v,
                               microbatches, local_batch) for c in range(v))


def pipeline_theory(sizes: Sequence[float], layers: tuple[int, int], stage: int, pp: int,
                    microbatches: int, local_batch: int, headers: bool = True) -> float:
    """Bytes stage ``stage`` of ``pp`` sends in one step over its pipeline neighbours."""
    first, last = layers
    header = HEADER_BYTES * microbatches if headers else 0
    sent = 0.0
    if stage < pp - 1:
        sent += local_batch * sizes[last] + header
    if stage > 0 and first > 0:
        sent += local_batch * sizes[first - 1] + header
    return sent


def tied_weights(pipe: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None
                 ) -> Any:
    """The weights ``model`` (what the pipeline cut) lists as ``tied`` across its first and
    last stage, kept equal (:class:`~disttrain.parallel.pipeline.hf.TiedWeights`), or None
    (nothing tied; every rank of the pipeline calls this, which makes the group)."""
    tied = getattr(model, "tied", None)
    if not tied:
        return None
    from disttrain.parallel.pipeline.hf import TiedWeights

    return TiedWeights(pipe, tied, optimizer)


def device_of(sample: Any) -> torch.device:
    """The device of a batch's first tensor (a dict batch's too)."""
    leaf = next(iter(sample.values())) if isinstance(sample, dict) else sample
    return leaf.device if isinstance(leaf, torch.Tensor) else torch.device("cpu")


@dataclass(frozen=True)
class PipelineSettings:
    schedule: str | None  # None: model parallel (a pipeline of one micro-batch)
    microbatches: int
    stage: int
    pp_size: int
    dp_rank: int
    dp_size: int
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B when > 1)


class PipelineStrategy(Strategy):
    """This rank's stage of a pipeline (``PipelineParallel``; model parallelism is one of
    a single micro-batch), trained by the shared loop."""

    def __init__(self, ctx: BuildContext, pipe: Any, settings: PipelineSettings) -> None:
        params = list(pipe.parameters())
        optimizer = ctx.make_optimizer(params) if params else None
        super().__init__(pipe.module, optimizer, ctx.require_comm(ctx.config.strategy))
        self.pipe, self.settings = pipe, settings
        self.tied = tied_weights(pipe, ctx.module, optimizer)  # GPT-2's embedding and head
        self.eval_min_rows = settings.microbatches
        self.steps: list[Any] = []  # StepStats per step
        local_batch = ctx.config.global_batch // settings.dp_size
        sizes = activation_sizes(ctx.module, ctx.sample[0], autocast_factory(
            ctx.config.precision, device_of(ctx.sample[0]).type),
            rows=local_batch // settings.microbatches)
        theory = stage_theory(sizes, held_layers(pipe), settings.stage, settings.pp_size,
                              settings.microbatches, local_batch)
        if settings.dp_size > 1:
            grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            theory += ring_all_reduce_bytes(settings.dp_size, grads)
            theory += ring_all_reduce_bytes(settings.dp_size, 8)  # the loss, float64
        if self.tied is not None:  # the tied gradients' sum over the first and last stage
            theory += self.tied.theory_bytes()
        self.theory_bytes_per_step = theory

    @property
    def dp_rank(self) -> int:
        return self.settings.dp_rank

    @property
    def dp_size(self) -> int:
        return self.settings.dp_size

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Autocast) -> torch.Tensor:
        (inputs, targets), = micro_batches  # the config check allows no accumulation here
        self.module.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        scale = 1.0 if self.scaler is None else self.scaler.scale_value

        def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return loss_fn(output, target) * scale  # fp16: the gradients come back scaled

        with autocast():
            loss = self.pipe.train_step(inputs if self.pipe.is_first else None,
                                        targets if self.pipe.is_last else None,
                                        loss_fn if self.scaler is None else scaled)
        if self.optimizer is not None:
            self.optimizer.step()  # fp16: through the scaler (use_loss_scaler)
        else:
            if self.scaler is not None:
                self.scaler.no_step()  # a stage without parameters still takes part
            if self.clipper is not None:
                self.clipper.no_update()  # and in the global gradient norm
        return torch.tensor(loss / scale, dtype=torch.float64)

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        """This stage's gradients on replica 0 (the replicas hold the same, averaged);
        summed over every rank of the pipeline's grid."""
        from disttrain.train.clipping import squares

        mine = squares(self.module.parameters())
        if self.tied is not None:  # a weight held twice (tied) counts once
            mine = mine - squares(self.tied.copies())
        return (mine if self.settings.dp_rank == 0 else torch.zeros_like(mine)), self.comm

    def after_step(self) -> None:
        if self.pipe.last_step is not None:
            self.steps.append(self.pipe.last_step)

    # ------------------------------------------------------------------ evaluation
    def predict(self, inputs: Any) -> torch.Tensor | None:
        output: torch.Tensor | None = self.pipe.eval_forward(
            inputs if self.pipe.is_first else None)
        return output

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor:
        """The last stage's scores on every rank; share_from_last averages over the dp
        replicas, so × dp_size is their sum (counts rounded back to integers)."""
        shared = [self.pipe.share_from_last(float(v)) * self.dp_size for v in totals.tolist()]
        shared[0], shared[1] = round(shared[0]), round(shared[1])
        return torch.tensor(shared, dtype=torch.float64)

    # ------------------------------------------------------------------ checkpoints
    def _state_file(self, path: str) -> str:
        s = self.settings
        return os.path.join(path, f"state-stage{s.stage:05d}-of-{s.pp_size:05d}.pt")

    def checkpoint_layout(self) -> Layout:
        """This stage's parameters under the whole model's names, written by the first
        replica of the stage (a stage without parameters holds none)."""
        from disttrain.parallel import universal

        named = self.pipe.named_module()
        optimizer = self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None
        return universal.module_layout(named.named_parameters(), optimizer,
                                       buffers=universal.persistent_buffers(named),
                                       splits=self.tensor_splits(),
                                       writes=writes_once(self.settings.dp_rank == 0,
                                                          self.tensor_rank()))

    def tensor_splits(self) -> dict[int, Split]:
        """How tensor parallelism cut this stage's parameters (none: ``3d`` cuts them)."""
        return {}

    def tensor_rank(self) -> int:
        """This stage's rank in its tensor-parallel group (0: it has none)."""
        return 0

    def load_state(self, path: str, rank: int) -> None:
        """The universal checkpoint, written under any strategy and split; or this stage's
        ``state-stage*`` file (the format before it, which needs the same split)."""
        from disttrain.parallel import universal

        directory = os.path.join(path, universal.DIRECTORY)
        if universal.is_universal(directory):
            universal.load(directory, self.checkpoint_layout())
            return
        self._load_legacy(path)

    def _load_legacy(self, path: str) -> None:
        file = self._state_file(path)
        if not os.path.exists(file):
            raise missing_state(path, f"{os.path.basename(file)} (stage {self.settings.stage} "
                                      f"of a {self.settings.pp_size}-stage pipeline)")
        state = safe_load(file)
        held = held_layers(self.pipe)
        if list(state["layers"]) != held:
            raise ValueError(f"checkpoint {path}: stage {self.settings.stage} held layers "
                             f"{state['layers']}, here it holds {held} (first and last of each "
                             f"chunk); resume with the same --partition and --pp, without "
                             f"--virtual-stages (files of this format have no chunks)")
        self.module.load_state_dict(state["model"])
        if isinstance(self.optimizer, torch.optim.Optimizer):
            self.optimizer.load_state_dict(state["optimizer"])

    def trained_module(self) -> nn.Module:
        """This stage's layers under the model's own names (``blocks.1.fc.weight``)."""
        named = getattr(self.pipe, "named_module", None)
        return named() if named is not None else self.module

    # ------------------------------------------------------------------ measurements
    def communicators(self) -> list[Communicator]:
        mesh = getattr(self.pipe, "mesh", None)
        comms = [self.comm] + (mesh.communicators() if mesh is not None else [])
        link = self.pipe.link
        comms += link.communicators() if link is not None else []  # the message channels
        unique: dict[int, Communicator] = {}
        for c in comms:
            if c is not None:
                unique.setdefault(id(c), c)
        return list(unique.values())

    def extras(self, warmup_steps: int) -> dict[str, Any]:
        s = self.settings
        timed = self.steps[warmup_steps:] or self.steps
        wall = sum(t.wall_s for t in timed)
        p, m, v = s.pp_size, s.microbatches, s.virtual_stages
        return {
            "schedule": s.schedule or "model-parallel", "microbatches": m, "pp_size": p,
            "virtual_stages": v, "dp_size": s.dp_size, "stage": s.stage,
            "layers": held_layers(self.pipe),
            "idle_fraction": 1.0 - sum(t.busy_s for t in timed) / wall if wall > 0 else None,
            "bubble_theory": (p - 1) / (v * m + p - 1),
            "peak_stashed": max((t.peak_stashed for t in self.steps), default=0),
            "peak_activation_bytes": max((t.peak_activation_bytes for t in self.steps),
                                         default=0),
        }
