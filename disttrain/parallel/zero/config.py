"""ZeroConfig: the few knobs every ZeRO stage shares, validated on creation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from disttrain.comm.algorithms import ALGORITHMS

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]
"""Builds the optimizer from the flat shard tensors, e.g. ``lambda p: torch.optim.Adam(p, lr=1e-3)``
or ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``."""

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
# every step moves data with these two; a name must exist for both
_STEP_OPS = ("all_gather", "reduce_scatter")


@dataclass(frozen=True)
class ZeroConfig:
    """How a ZeRO wrapper keeps and moves its shards.

    * ``master_dtype``: dtype of the optimizer's flat shard ("master weights"). When it
      equals the model's parameter dtype the shard *is* the parameters' memory (no copy);
      when the model trains in bf16/fp16 and this is float32, each rank keeps an fp32 copy
      of its shard only, and casts after each step.
    * ``reduce_dtype``: dtype in which gradients are reduced (and the gradient shard kept,
      stages 2 and 3). ``None``: the parameters' dtype (2 bytes/param in bf16, the paper's
      accounting); ``torch.float32`` reduces bf16 gradients in fp32 (more exact, 2× bytes).
    * ``bucket_bytes``: stage 2 reduces gradients in buckets of about this size during
      backward (a bucket is launched when all its gradients are ready).
    * ``inflight_buckets``: stages 2 and 3 wait for the oldest gradient reduction once this
      many are in flight, so staging buffers never add up to a full gradient (the peak of
      DeepSpeed#1302, where stage 2 used more memory than stage 1).
    * ``prefetch``: stage 3 starts gathering the next layer's parameters while the current
      layer computes.
    * ``broadcast_from_rank0``: copy rank 0's initial parameters to every rank on wrap, so
      replicas start equal even if each rank seeded differently.
    * ``algorithm``: collective algorithm of every all-gather and reduce-scatter (``None``:
      the communicator's default; ``"auto"``: chosen by the cost model). The one broadcast
      on wrap uses it too when broadcast has an algorithm of that name (``"ring"`` has
      none: the communicator's default broadcasts then).
    """

    master_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype | None = None
    bucket_bytes: int = 4 << 20
    inflight_buckets: int = 2
    prefetch: bool = True
    broadcast_from_rank0: bool = True
    algorithm: str | None = None

    def __post_init__(self) -> None:
        if self.master_dtype not in _FLOATS:
            raise ValueError(f"master_dtype must be a floating dtype (usually torch.float32), "
                             f"got {self.master_dtype!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in _FLOATS:
            raise ValueError(f"reduce_dtype must be None or a floating dtype, got "
                             f"{self.reduce_dtype!r}")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or (
                self.bucket_bytes < 1):
            raise ValueError(f"bucket_bytes must be a positive int (bytes per gradient bucket), "
                             f"got {self.bucket_bytes!r}")
        if isinstance(self.inflight_buckets, bool) or not isinstance(self.inflight_buckets, int) \
                or self.inflight_buckets < 1:
            raise ValueError(f"inflight_buckets must be an int ≥ 1, got {self.inflight_buckets!r}")
        for name in ("prefetch", "broadcast_from_rank0"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        choices = [a for a in ALGORITHMS[_STEP_OPS[0]] if all(a in ALGORITHMS[op]
                                                              for op in _STEP_OPS)]
        if self.algorithm is not None and self.algorithm not in ("auto", *choices):
            raise ValueError(f"algorithm={self.algorithm!r} is not an all-gather and "
                             f"reduce-scatter algorithm; choose None (the communicator's "
                             f"default), 'auto' or one of: {', '.join(choices)}")

    def algorithm_for(self, op: str) -> str | None:
        """``algorithm`` if collective ``op`` has an algorithm of that name, else ``None``
        (the communicator's default)."""
        if self.algorithm is None or self.algorithm == "auto":
            return self.algorithm
        return self.algorithm if self.algorithm in ALGORITHMS[op] else None
