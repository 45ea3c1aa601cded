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
dtype, so G there is its size. Hybrid sharding (:mod:`.hybrid`: shards inside groups of S
ranks, replicas across them) divides by S instead of N: ZeRO-3 holds 16Ψ/S.

:func:`measure` counts each storage once (views of one flat buffer are one allocation) and
attributes it to the first category that holds it. It counts what a rank *keeps* between
steps; transient buffers (communication buckets, a layer gathered for its forward) are freed
by the end of ``step()`` and are not model states. :class:`WrapMemory` counts the other
moment that matters, wrapping: what a wrapper materialises at once (meta initialisation,
:mod:`.meta`, keeps it at the shards plus one unit).
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
            grad_bytes: int, optimizer_bytes: int, dp_shard: int | None = None
            ) -> ModelStateBytes:
    """The paper's model-state bytes per rank for ``numel`` (Ψ) parameters on N ranks,
    sharded to ZeRO ``stage`` (0: replicated, as DDP keeps them; ``"ddp"`` and
    ``"zeroS"`` are accepted too).

    ``optimizer_bytes`` is K per parameter (master copy + optimizer state); ``grad_bytes``
    the bytes of one (kept) gradient element. ``dp_shard``: hybrid sharding's shard-group
    size S (a divisor of N; the N/S replicas hold the same shards), so what is sharded is
    divided by S; ``None``: every rank shards (S = N).
    """
    s = _stage(stage)
    if world_size < 1 or numel < 0:
        raise ValueError(f"need world_size ≥ 1 and numel ≥ 0, got {world_size}, {numel}")
    if dp_shard is not None and (isinstance(dp_shard, bool) or not isinstance(dp_shard, int)
                                 or dp_shard < 1 or world_size % dp_shard):
        raise ValueError(f"dp_shard must be an int ≥ 1 that divides world_size={world_size} "
                         f"(shard groups of S ranks, N/S replicas), got {dp_shard!r}")
    psi, n = numel, world_size if dp_shard is None else dp_shard
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
    shard = zero.comm.world_size
    replicas = 1 if zero.replicate is None else zero.replicate.world_size
    return formula(zero.stage, zero.numel, shard * replicas,
                   param_bytes=size(zero.param_dtype), grad_bytes=size(grad_dtype),
                   optimizer_bytes=k, dp_shard=shard)


def zero_measured(zero: ZeroWrapper) -> ModelStateBytes:
    """What a ZeRO wrapper's rank holds now, measured from its tensors."""
    return measure(zero.model_state_tensors())


class WrapMemory:
    """Bytes of the tensors a wrapper holds while it wraps: live now and the most at once.

    It counts what the wrapper allocates (flat buffers, gathered units, shards, masters,
    materialised buffers) and, when the model arrives materialised, the model's own
    storages, released as the wrapper rebinds its parameters. Each storage counts once. It
    is a count, not the allocator's figure: temporaries inside an initialiser and a
    collective's scratch are not in it (on a GPU, ``torch.cuda.max_memory_allocated`` sees
    those too).
    """

    def __init__(self) -> None:
        self._live: dict[int, int] = {}  # storage address → bytes
        self.live_bytes = 0
        self.peak_bytes = 0

    @classmethod
    def of_model(cls, module: torch.nn.Module) -> WrapMemory:
        """Start from what ``module`` holds already (nothing when it is on the meta device)."""
        memory = cls()
        memory.add(*module.parameters(), *module.buffers())
        return memory

    def add(self, *tensors: torch.Tensor) -> None:
        """Count tensors just made (views of a counted storage add nothing)."""
        for t in tensors:
            storage = t.untyped_storage()
            if t.is_meta or storage.nbytes() == 0 or storage.data_ptr() in self._live:
                continue
            self._live[storage.data_ptr()] = storage.nbytes()
            self.live_bytes += storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def drop(self, *tensors: torch.Tensor) -> None:
        """Uncount tensors about to be freed (call before their storage goes)."""
        for t in tensors:
            if not t.is_meta:
                self.live_bytes -= self._live.pop(t.untyped_storage().data_ptr(), 0)

    def as_dict(self) -> dict[str, int]:
        return {"live": self.live_bytes, "peak": self.peak_bytes}
