"""Gradient clipping by the global norm, on gradients spread over ranks.

torch's ``clip_grad_norm_`` takes the norm of the gradients a process holds. Under disttrain
a process holds a replica (DDP), a shard (ZeRO), a stage (pipelines) or a slice (tensor
parallelism) of the model's gradient, so the norm of the whole model's gradient is a sum
over ranks in which every parameter element counts once::

    norm² = Σ_ranks share_r          share_r: what rank r alone holds of the gradient

    DDP              every rank holds all of it, identical: share = all, no sum
    ZeRO-1/2/3       disjoint shards: share = the shard, summed over dp
    pipeline (× dp)  disjoint stages, dp replicas identical: share = the stage on dp rank 0
    tensor parallel  split parameters: their slice; replicated ones (LayerNorms,
                     row-parallel biases) on tp rank 0 only; on dp rank 0 only
    tp × ZeRO        the reduced gradient shard of each dp rank (disjoint), with the
                     tensor-parallel rule inside it: replicated elements on tp rank 0

Each strategy says what its share is and over which communicator the shares add up
(:meth:`~disttrain.train.strategies.base.Strategy.grad_norm_share`). The clipper runs as a
step pre-hook of the optimizer that applies the update (ZeRO's: its shard's optimizer,
between the reduce-scatter and the update), after fp16's loss scaler has unscaled the
gradients, so every rank scales its gradients by the same ``max_norm / (norm + 1e-6)``
(at most 1), as torch does. A rank that updates nothing (a pipeline stage without
parameters) still takes part in the sum (:meth:`GradClipper.no_update`).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from disttrain.comm import Communicator

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


class ClipTarget(Protocol):
    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]: ...


def squares(params: Any) -> torch.Tensor:
    """Σ of the squared elements of ``params``' gradients (those that have one), float64."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            total = total + p.grad.detach().to(torch.float64).pow(2).sum().cpu()
    return total


def _split_ids(module: torch.nn.Module) -> set[int]:
    """The parameters of which a tp rank holds a slice (its layers' ``tp_split``)."""
    return {id(getattr(m, name)) for m in module.modules()
            for name in getattr(m, "tp_split", {}) if getattr(m, name, None) is not None}


def tp_share(module: torch.nn.Module, mesh: Any) -> torch.Tensor:
    """This rank's share of a tensor-parallel model's squared gradient norm: parameters a
    tp rank holds a slice of (``tp_split``), replicated ones once (tp rank 0), one replica
    of them all (dp rank 0)."""
    split = _split_ids(module)
    params = list(module.parameters())
    share = squares(p for p in params if id(p) in split)
    if mesh.tp_rank == 0:
        share = share + squares(p for p in params if id(p) not in split)
    return share if mesh.dp_rank == 0 else torch.zeros_like(share)


def tp_shard_share(zero: Any, module: torch.nn.Module, tp_rank: int) -> torch.Tensor:
    """This rank's share under ZeRO over the dp groups of a tensor-parallel mesh: the
    squares of its reduced gradient shards (``zero``'s masters' ``.grad``, set during its
    ``step()``; disjoint over dp), elements of replicated parameters on tp rank 0 only."""
    ids = _split_ids(module)
    split = {n for n, p in module.named_parameters() if id(p) in ids}
    total = torch.zeros((), dtype=torch.float64)
    for group in zero.shard_groups():
        grad = group.master.grad
        if grad is None:
            continue
        for pc in group.layout.pieces[zero.comm.rank]:
            if tp_rank == 0 or group.names[pc.param] in split:
                part = grad[pc.shard_offset:pc.shard_offset + pc.length]
                total = total + part.detach().to(torch.float64).pow(2).sum().cpu()
    return total


def global_norm(target: ClipTarget) -> float:
    """The whole model's gradient norm, the same on every rank (a collective where the
    gradients are spread: every rank of the target's group calls it)."""
    share, comm = target.grad_norm_share()
    total = share.to(torch.float64).reshape(1).clone()
    if comm is not None and comm.world_size > 1:
        comm.all_reduce(total)
    return math.sqrt(float(total[0]))


class GradClipper:
    """Clips the gradients of ``target`` (a strategy) to ``max_norm`` before each update;
    ``norms`` holds every step's norm before clipping (inf where fp16 skipped the step)."""

    def __init__(self, target: ClipTarget, max_norm: float, scaler: Any = None) -> None:
        if not max_norm > 0 or not math.isfinite(max_norm):
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.target, self.max_norm, self.scaler = target, float(max_norm), scaler
        self.norms: list[float] = []

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Clip before every ``optimizer.step()`` (register after the loss scaler's hook)."""
        optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.clip(params)

    def clip(self, params: list[torch.Tensor]) -> float:
        """Scale ``params``' gradients so the global norm is at most ``max_norm``; returns
        the norm before clipping."""
        norm = global_norm(self.target)
        skipped = self.scaler is not None and any(self.scaler._found_inf.values())
        if not skipped and math.isfinite(norm):
            coef = min(1.0, self.max_norm / (norm + _EPS))
            if coef < 1.0:
                grads = [p.grad for p in params if p.grad is not None]
                if grads:
                    torch._foreach_mul_(grads, coef)
        self.norms.append(math.inf if skipped else norm)
        return norm

    def no_update(self) -> None:
        """This rank updates nothing this step; it takes part in the norm all the same."""
        self.clip([])


def clip_grad_norm_(target: Any, max_norm: float) -> float:
    """Clip the whole model's gradient to ``max_norm`` now, and return its norm before
    clipping, the same on every rank: for a hand-written loop, between backward and the
    optimizer's step. ``target``: a strategy of :mod:`disttrain.train.strategies`; what
    :func:`~disttrain.parallel.tensor.parallelize` returned (slices on every tp rank); a
    pipeline (:class:`~disttrain.parallel.pipeline.PipelineParallel`: its stages); a module
    whose gradients are whole on this rank (a plain module, or
    :class:`~disttrain.parallel.DataParallel` after backward). A collective over the ranks
    that hold parts of the gradient. A ZeRO wrapper reduces its gradient shards inside
    ``step()``: :func:`clip_on_step` clips there. A tensor-parallel shard's bare module is
    refused: its norm would be one slice's."""
    if hasattr(target, "zero_grad") and hasattr(target, "shard_groups"):
        raise TypeError("a ZeRO wrapper reduces its gradient shards inside step(): call "
                        "disttrain.clip_on_step(zero, max_norm) once instead; it clips the "
                        "reduced shards before every step and keeps each step's norm")
    if hasattr(target, "grad_norm_share"):
        optimizer = target.update_optimizer()
        params = ([p for g in optimizer.param_groups for p in g["params"]]
                  if optimizer is not None else list(target.module.parameters()))
        return GradClipper(target, max_norm).clip(params)
    part = _part_of(target)
    if part is not None:
        return GradClipper(part, max_norm).clip(list(target.module.parameters()))
    if isinstance(target, torch.nn.Module):
        module = getattr(target, "module", target)
        if any(getattr(m, "tp_split", None) for m in module.modules()):
            raise TypeError("this module is a tensor-parallel shard, whose gradients are "
                            "slices: pass the object parallelize() returned, so the norm is "
                            "taken over every tp rank")
        whole = _Whole(module)
        return GradClipper(whole, max_norm).clip(list(module.parameters()))
    raise TypeError(f"clip_grad_norm_ takes a disttrain strategy, what parallelize() "
                    f"returned, a pipeline or an nn.Module, got {type(target).__name__}")


def clip_on_step(zero: Any, max_norm: float) -> GradClipper:
    """Clip a ZeRO wrapper's gradient to ``max_norm`` before each of its ``step()`` calls,
    on the reduced shards (disjoint: their squares summed over the shard group, whose
    replicas under hybrid sharding hold the same); returns the clipper, whose ``norms`` is
    every step's norm before clipping. Call once, after building the wrapper."""
    if not (hasattr(zero, "shard_groups") and hasattr(zero, "optimizer")):
        raise TypeError(f"clip_on_step takes a ZeRO wrapper (ZeRO1, ZeRO2, ZeRO3), got "
                        f"{type(zero).__name__}; use clip_grad_norm_ for the others")
    if any(getattr(m, "tp_split", None) for m in zero.module.modules()):
        raise TypeError("this ZeRO wrapper shards a tensor-parallel model: clip through its "
                        "strategy (disttrain run --clip-grad-norm), which counts the slices")
    clipper = GradClipper(_Shards(zero), max_norm)
    clipper.attach(zero.optimizer)
    return clipper


class _Shards:
    """A ZeRO wrapper's reduced gradient shards: disjoint over its shard group."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        params = [p for g in self.zero.optimizer.param_groups for p in g["params"]]
        return squares(params), self.zero.comm


def _part_of(target: Any) -> ClipTarget | None:
    """The share of what :func:`~disttrain.parallel.tensor.parallelize` returned (split
    parameters on every tp rank, replicated ones on tp rank 0) or of a pipeline (its stage,
    on the first replica), or None for anything else."""
    from types import SimpleNamespace

    from disttrain.parallel.pipeline import PipelineParallel
    from disttrain.parallel.tensor import Parallelized

    if isinstance(target, Parallelized):
        comm = target.group.comm
        place = SimpleNamespace(tp_rank=comm.rank, dp_rank=0)
        return _Share(lambda: tp_share(target.module, place), comm)
    if isinstance(target, PipelineParallel):
        mesh = target.mesh
        return _Share(lambda: squares(target.parameters()) if mesh.dp_rank == 0 else
                      torch.zeros((), dtype=torch.float64), mesh.world)
    return None


class _Share:
    def __init__(self, share: Any, comm: Communicator | None) -> None:
        self.share, self.comm = share, comm

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        return self.share(), self.comm


class _Whole:
    """A module whose gradients are whole on this rank: its share is all of it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def grad_norm_share(self) -> tuple[torch.Tensor, Communicator | None]:
        return squares(self.module.parameters()), None
