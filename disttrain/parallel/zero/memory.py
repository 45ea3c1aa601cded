"""Model-state memory per rank: measured from the tensors, and the ZeRO paper's formula.

Model states are parameters, gradients and optimizer state (Rajbhandari et al. 2020, §3).
With Ψ trainable parameters, N ranks, P bytes per parameter, G per gradient and K per
parameter of optimizer state (fp32 master weights included)::

    strategy   parameters   gradients   optimizer      bf16 + Adam (P=G=2, K=12)
    DDP        PΨ           GΨ          KΨ             16Ψ
    ZeRO-1     PΨ           GΨ          KΨ/N           4Ψ + 12Ψ/N
    ZeRO-2     PΨ           GΨ/N        KΨ/N           2Ψ + 14Ψ/N
    ZeRO-3     PΨ/N         GΨ/N        KΨ/N           16Ψ/N

fp32 Adam has P = G = 4 and K = 8 (no separate master: the shard is the parameter), so
DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N; SGD with momentum has K = 4
(fp32) or 8 (bf16 with fp32 master). Stages 2 and 3 keep the gradient shard in the reduce
dtype, so G there is its size.

:func:`measure` counts each storage once (views of one flat buffer are one allocation) and
attributes it to the first category that holds it. It counts what a rank *keeps* between
steps; transient buffers (communication buckets, a layer gathered for its forward) are freed
by the end of ``step()`` and are not model states.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from disttrain.parallel.zero.sharding import ZeroWrapper

STAGES = (0, 1, 2, 3)  # 0: replicated model state (DDP); 1-3: ZeRO's stages


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of parameters, gradients and optimizer state held by one rank."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "total": self.total}


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's parameters (the master shards) and every tensor in its state."""
    tensors = [p for group in optimizer.param_groups for p in group["params"]]
    for state in optimizer.state.values():
        tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


def measure(categories: Mapping[str, Iterable[torch.Tensor]]) -> ModelStateBytes:
    """Bytes per category (``params``, ``grads``, ``optimizer``), each storage counted once."""
    seen: set[int] = set()
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    for name in totals:
        for tensor in categories.get(name, ()):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            totals[name] += storage.nbytes()
    return ModelStateBytes(**totals)


def measure_module(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ModelStateBytes:
    """Measure an unsharded run (DDP or a single process): params, their grads, the state."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    return measure({"params": params, "grads": grads, "optimizer": optimizer_tensors(optimizer)})


def formula(stage: int | str, numel: int, world_size: int, *, param_bytes: int,
            grad_bytes: int, optimizer_bytes: int) -> ModelStateBytes:
    """The paper's model-state bytes per rank for ``numel`` (Ψ) parameters on N ranks,
    sharded to ZeRO ``stage`` (0: replicated, as DDP keeps them; ``"ddp"`` and
    ``"zeroS"`` are accepted too).

    ``optimizer_bytes`` is K per parameter (master copy + optimizer state); ``grad_bytes``
    the bytes of one (kept) gradient element.
    """
    s = _stage(stage)
    if world_size < 1 or numel < 0:
        raise ValueError(f"need world_size ≥ 1 and numel ≥ 0, got {world_size}, {numel}")
    psi, n = numel, world_size
    params = param_bytes * psi // (n if s >= 3 else 1)
    grads = grad_bytes * psi // (n if s >= 2 else 1)
    opt = optimizer_bytes * psi // (n if s >= 1 else 1)
    return ModelStateBytes(params, grads, opt)


def _stage(stage: int | str) -> int:
    """``stage`` as 0-3 (a preset's name, ``ddp`` or ``zeroS``, is read as its stage)."""
    if isinstance(stage, str):
        name = stage
        stage = 0 if name == "ddp" else int(name[4:]) if (
            name.startswith("zero") and name[4:].isdigit()) else -1
        if stage not in STAGES:
            raise ValueError(f"stage must be 0-3 (or ddp, zero1..zero3), got {name!r}")
    if stage not in STAGES:
        raise ValueError(f"stage must be 0-3 (0: replicated, as DDP), got {stage!r}")
    return stage


_STATE_SLOTS: dict[str, Any] = {
    # optimizer class name → number of parameter-sized state tensors (given its settings)
    "SGD": lambda g: 1 if g.get("momentum", 0) else 0,
    "Adam": lambda g: 3 if g.get("amsgrad") else 2,
    "AdamW": lambda g: 3 if g.get("amsgrad") else 2,
    "Adamax": lambda g: 2,
    "NAdam": lambda g: 2,
    "RAdam": lambda g: 2,
    "Adagrad": lambda g: 1,
    "RMSprop": lambda g: 1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered") else 0),
}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, master_dtype: torch.dtype,
                          param_dtype: torch.dtype) -> int:
    """K: bytes per parameter of optimizer state, plus the master copy when it is separate
    (its dtype differs from the parameters'). Known for torch's common optimizers."""
    name = type(optimizer).__name__
    if name not in _STATE_SLOTS:
        raise ValueError(f"the optimizer state formula knows {', '.join(sorted(_STATE_SLOTS))}, "
                         f"not {name}; pass optimizer_bytes to formula() yourself")
    slots = _STATE_SLOTS[name](optimizer.param_groups[0])
    master_dtype = torch.promote_types(master_dtype, param_dtype)  # never narrower
    element = torch.empty(0, dtype=master_dtype).element_size()
    master = element if master_dtype != param_dtype else 0
    return master + slots * element


def zero_formula(zero: ZeroWrapper) -> ModelStateBytes:
    """The formula for a ZeRO wrapper (``ZeRO1/2/3``) with its own precision settings."""
    def size(dtype: torch.dtype) -> int:
        return torch.empty(0, dtype=dtype).element_size()

    sharded_grads = zero.stage >= 2
    grad_dtype = zero.reduce_dtype if sharded_grads else zero.param_dtype
    k = optimizer_state_bytes(zero.optimizer, zero.config.master_dtype, zero.param_dtype)
    return formula(zero.stage, zero.numel, zero.comm.world_size,
                   param_bytes=size(zero.param_dtype), grad_bytes=size(grad_dtype),
                   optimizer_bytes=k)


def zero_measured(zero: ZeroWrapper) -> ModelStateBytes:
    """What a ZeRO wrapper's rank holds now, measured from its tensors."""
    return measure(zero.model_state_tensors())
