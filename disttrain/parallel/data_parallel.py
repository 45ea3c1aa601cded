"""DataParallel: synchronous data parallelism with bucketed, overlapped gradient all-reduce.

disttrain's counterpart of ``torch.nn.parallel.DistributedDataParallel`` (Li et al., "PyTorch
Distributed", VLDB 2020), over a :class:`~disttrain.comm.Communicator`::

    model = DataParallel(model, comm)          # same model on every rank; rank 0's weights win
    for x, y in shard_of_the_data:             # each rank its own batch
        loss = loss_fn(model(x), y)            # forward: buffers re-broadcast from rank 0
        loss.backward()                        # hooks all-reduce buckets while backward runs
        optimizer.step()                       # every .grad is the mean over ranks
        optimizer.zero_grad()

With a loss that is a mean over the batch, averaging the ranks' gradients gives exactly the
gradient of the mean over the global batch (world_size × batch), so N ranks take the same
steps as one process on N times the batch. ``no_sync()`` accumulates gradients locally for
gradient accumulation; the next synced backward all-reduces the accumulated sum.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.comm import ALGORITHMS, Communicator
from disttrain.parallel.buckets import MIB, Bucket
from disttrain.parallel.compression import Compressor, NoCompression, make_compressor
from disttrain.parallel.consistency import broadcast_tensors, check_same_tensors
from disttrain.parallel.reducer import GradReducer, OverlapReport, SyncTiming, overlap_report

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataParallelConfig:
    """DataParallel's options, validated on creation (defaults are torch DDP's)."""

    bucket_cap_mb: float = 25.0  # MiB per bucket after the first
    first_bucket_mb: float = 1.0  # MiB in the first bucket (small: starts communicating early)
    find_unused_parameters: bool = False  # True: tolerate parameters without gradient
    broadcast_buffers: bool = True  # re-broadcast buffers from rank 0 before each forward
    algorithm: str | None = None  # all-reduce algorithm; None: the communicator's default

    def __post_init__(self) -> None:
        for name in ("bucket_cap_mb", "first_bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of MiB (e.g. 25 or 0.5), "
                                 f"got {value!r}")
        for name in ("find_unused_parameters", "broadcast_buffers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        choices = ALGORITHMS["all_reduce"]
        if self.algorithm not in (None, "auto", *choices):
            raise ValueError(f"algorithm={self.algorithm!r} is not an all-reduce algorithm; "
                             f"choose None (the communicator's default), 'auto' or one of: "
                             f"{', '.join(choices)}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_cap_mb * MIB))

    @property
    def first_bucket_bytes(self) -> int:
        return max(1, int(self.first_bucket_mb * MIB))


class DataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves the rank-averaged gradient in every
    ``param.grad``. Every rank must wrap the same architecture; rank 0's parameters and
    buffers are copied to the others on construction."""

    def __init__(self, module: nn.Module, comm: Communicator, *, bucket_cap_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, compression: Compressor | str | None = None,
                 algorithm: str | None = None) -> None:
        super().__init__()
        self.config = DataParallelConfig(bucket_cap_mb, first_bucket_mb, find_unused_parameters,
                                         broadcast_buffers, algorithm)
        if not isinstance(module, nn.Module):
            raise ValueError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
        if not hasattr(comm, "all_reduce") or not hasattr(comm, "world_size"):
            raise ValueError(f"comm must be a disttrain Communicator, got {type(comm).__name__}")
        self.module = module
        self.comm = comm
        comm.expect_workload("collectives")  # Gloo's I/O threads yield to compute (auto)
        self.compressor = _compressor(compression)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DataParallel: the module has no parameter that requires grad; "
                             "there is nothing to synchronize")
        check_same_tensors(comm, [*module.named_parameters(), *module.named_buffers()],
                           what="parameter or buffer")
        broadcast_tensors(comm, [*module.parameters(), *module.buffers()])
        self._sync_buffers = [b for b in module.buffers() if b.numel()]
        self.reducer = GradReducer(named, comm, self.compressor,
                                   first_bucket_bytes=self.config.first_bucket_bytes,
                                   bucket_bytes=self.config.bucket_bytes,
                                   find_unused_parameters=find_unused_parameters,
                                   algorithm=algorithm)
        self._require_sync = True
        log.debug("DataParallel on rank %d: %d parameters in %d buckets (%s)", comm.rank,
                  len(named), len(self.reducer.buckets), self.compressor)

    # ------------------------------------------------------------------ forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._require_sync and torch.is_grad_enabled():
            # Only when a synced backward may follow, like torch DDP: evaluation under
            # no_grad issues no collective, so ranks may evaluate different batch counts.
            if self.config.broadcast_buffers and self._sync_buffers and self.comm.world_size > 1:
                broadcast_tensors(self.comm, self._sync_buffers)
            self.reducer.arm()
        else:
            self.reducer.disarm()
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward passes inside skip the gradient all-reduce: gradients accumulate locally
        in ``.grad``; the first synced backward after it all-reduces the accumulated sum."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    # ------------------------------------------------------------------ introspection
    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (bucket 0 holds the last layers)."""
        return self.reducer.buckets

    @property
    def last_sync(self) -> SyncTiming:
        """Times of the last synced backward: launches, end of backward, grads final."""
        return self.reducer.timing

    def last_overlap(self) -> OverlapReport:
        """How much of the last synced backward's communication hid behind backward, from
        the communicator's flight recorder (call it after the step, outside timed code)."""
        timing = self.reducer.timing
        return overlap_report(timing, self.comm.flight_recorder.recent(timing.armed_at))


def _compressor(compression: Compressor | str | None) -> Compressor:
    if compression is None:
        return NoCompression()
    if isinstance(compression, str):
        return make_compressor(compression)
    if isinstance(compression, Compressor):
        return compression
    raise ValueError(f"compression must be None, a name ('fp16', 'bf16', 'topk', 'powersgd') or "
                     f"a Compressor, got {type(compression).__name__}")
