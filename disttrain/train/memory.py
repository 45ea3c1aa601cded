"""Memory a strategy holds on a rank, measured from its tensors: model states and activations.

Two figures that describe a *strategy* (the process's resident set also holds Python, torch
and its libraries, several hundred MB that every strategy pays alike):

* **model-state bytes**: parameters, gradients and optimizer state the rank keeps between
  steps (Rajbhandari et al. 2020, §3). Counted from the live tensors a strategy names
  (:meth:`~disttrain.train.strategies.base.Strategy.model_state_tensors`), each storage once:
  DDP's gradients are views of its flat buckets, ZeRO's parameters views of one flat
  buffer, and counting views would count one allocation many times. FSDP's and DeepSpeed's
  sharded tensors (DTensor) are counted by their local shard, and a storage by the bytes
  the named tensors span (a shared-memory bucket maps every rank's region; its own counts).
* **peak activation bytes**: the most bytes that autograd held saved for backward at once
  during a step, counted by saved-tensor hooks (each storage once, parameters and views of
  them left out: they are model states). A pipeline's micro-batches in flight are what make
  GPipe hold more than 1F1B; ZeRO-3's gathered parameters are left out with the others.

:func:`formula` gives the ZeRO paper's figure for a data-parallel strategy to set next to
the measured one. With Adam in fp32 (4 bytes of parameter, 4 of gradient, 8 of state per
parameter)::

    replicated (single, DDP)  4Ψ + 4Ψ + 8Ψ      = 16Ψ
    ZeRO-1                    4Ψ + 4Ψ + 8Ψ/N
    ZeRO-2                    4Ψ + (4 + 8)Ψ/N
    ZeRO-3 (FSDP)             16Ψ/N
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from disttrain.parallel.zero import memory as zero_memory
from disttrain.parallel.zero.memory import ModelStateBytes, formula

STAGES = zero_memory.STAGES  # what parallel.zero.memory.formula shards (0: replicated)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``tensor`` spans."""
    size = tensor.element_size()
    if tensor.numel() == 0:
        return 0, 0
    span = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(tensor.shape, tensor.stride()))
    start = int(tensor.storage_offset()) * size
    return start, start + span * size


def measure_state(categories: Mapping[str, Iterable[torch.Tensor]]) -> ModelStateBytes:
    """Bytes of ``params``, ``grads`` and ``optimizer`` tensors: for each storage, the bytes
    the named tensors span (overlaps once), attributed to the first category naming it.

    Spans rather than whole storages, because a storage can be larger than what it holds
    for the model: a shared-memory buffer maps every rank's region, of which a rank's
    gradients use its own."""
    spans: dict[int, list[tuple[int, int]]] = {}
    owner: dict[int, str] = {}
    for name in ("params", "grads", "optimizer"):
        for tensor in categories.get(name, ()):
            if not isinstance(tensor, torch.Tensor):
                continue
            local = local_tensor(tensor)
            try:
                storage = local.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other layouts
                continue
            key = storage.data_ptr()
            start, end = _extent(local)
            end = min(end, storage.nbytes())  # a freed buffer (resized to 0) holds nothing
            if end > start:
                spans.setdefault(key, []).append((start, end))
                owner.setdefault(key, name)
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    for key, intervals in spans.items():
        covered, reach = 0, -1
        for start, end in sorted(intervals):
            if end > reach:
                covered += end - max(start, reach)
                reach = end
        totals[owner[key]] += covered
    return ModelStateBytes(**totals)


def optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    """A torch optimizer's parameters (sharded optimizers: the shards it updates) and every
    tensor in its state; [] for anything else (a ZeRO wrapper names its own)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return []
    return zero_memory.optimizer_tensors(optimizer)


def state_bytes_per_param(optimizer: str, momentum: float) -> int:
    """K of the formula: bytes of optimizer state per fp32 parameter (Adam and AdamW keep two
    moments, SGD a momentum buffer when momentum > 0)."""
    if optimizer in ("adam", "adamw"):
        return 8
    return 4 if momentum > 0 else 0


def formula_bytes(stage: int | None, numel: int, world_size: int,
                  optimizer_bytes: int) -> ModelStateBytes | None:
    """The paper's model-state bytes per rank at ZeRO ``stage`` (0: replicated; fp32
    parameters and gradients), or None when the strategy has no such formula (pipelines,
    servers)."""
    if stage is None:
        return None
    return formula(stage, numel, world_size, param_bytes=4, grad_bytes=4,
                   optimizer_bytes=optimizer_bytes)


class _Saved:
    """A tensor autograd saved, with a note of it in the tracker while autograd keeps it."""

    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: ActivationTracker, key: int) -> None:
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self) -> None:  # autograd dropped it: after its backward, or the graph freed
        self.tracker._release(self.key)


class ActivationTracker:
    """``with tracker:`` counts the bytes autograd saves for backward; ``peak`` is the most
    held at once, over every ``with`` block so far.

    A saved tensor is a parameter or a view of one when its base is a leaf that requires
    grad: those are model states and are not counted. Storages are counted once however
    many saved tensors view them, and released when the last of them is."""

    def __init__(self) -> None:
        self.peak = 0
        self._current = 0
        self._live: dict[int, list[int]] = {}  # storage pointer → [bytes, saved tensors]
        self._hooks: Any = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad:
            return tensor
        try:
            storage = local_tensor(tensor).untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
            return tensor
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [nbytes, 1]
            self._current += nbytes
            self.peak = max(self.peak, self._current)
        else:
            entry[1] += 1
        return _Saved(tensor, self, key)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed  # type: ignore[no-any-return]

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self._current -= entry[0]

    def __enter__(self) -> ActivationTracker:
        # not traced by torch.compile (--compile): the counting runs as Python around it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            torch._dynamo.disable(self._pack), torch._dynamo.disable(self._unpack))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None


__all__ = ["STAGES", "ActivationTracker", "ModelStateBytes", "formula_bytes",
           "local_tensor", "measure_state", "optimizer_tensors", "state_bytes_per_param"]
