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

The package, in reading order:

* this file: :class:`DataParallel` and its config, and the start-up check that every rank
  built the same model (fingerprints all-gathered) before rank 0's weights are broadcast;
* :mod:`.buckets`: which parameters share a flat gradient buffer (a pure plan, reverse
  registration order, small first bucket), and the :class:`Bucket` that owns the buffer;
* :mod:`.reducer`: the autograd hooks that fill buckets during backward and launch their
  all-reduce in bucket order, overlapped with the rest of backward (the order and the end of
  backward come from :mod:`disttrain.parallel.backward`, shared with ZeRO);
* :mod:`.compression`: how one bucket is averaged over ranks (plain, fp16/bf16, top-k,
  PowerSGD), one interface in the shape of torch's DDP communication hooks.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.comm import ALGORITHMS, Communicator
from disttrain.parallel.ddp.buckets import MIB, Bucket
from disttrain.parallel.ddp.compression import Compressor, NoCompression, make_compressor
from disttrain.parallel.ddp.reducer import GradReducer, OverlapReport, SyncTiming, overlap_report

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


# ---------------------------------------------------------------- replicas start identical
# Check every rank built the same model, then copy rank 0's. The check all-gathers a small
# fingerprint per tensor (name hash, dtype, shape) instead of the tensors themselves, so it
# costs a few hundred bytes. Every rank sees every fingerprint, so a mismatch is found, and
# reported, on *every* rank, naming the first tensor that differs and what each rank holds
# there::
#
#     ValueError: DataParallel: parameter #4 differs across ranks: rank 0 has 'fc.weight'
#     (10, 84) torch.float32; rank 1 has 'fc.weight' (12, 84) torch.float32. ...

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128]
_MAX_DIMS = 4  # dims spelled out in the fingerprint (more are covered by numel)
_WIDTH = 4 + _MAX_DIMS
_NAME_BYTES = 200


def fingerprint(name: str, tensor: torch.Tensor) -> list[int]:
    """``[crc32(name), dtype code, ndim, numel, d0..d3]`` as ints (-1 pads missing dims)."""
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    dims = list(tensor.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(tensor.dim(), _MAX_DIMS))
    return [zlib.crc32(name.encode()), code, tensor.dim(), tensor.numel(), *dims]


def describe(row: Sequence[int]) -> str:
    """``(10, 84) torch.float32`` from a fingerprint row."""
    code, ndim, numel = row[1], row[2], row[3]
    dtype = str(_DTYPES[code]) if 0 <= code < len(_DTYPES) else "another dtype"
    if ndim <= _MAX_DIMS:
        return f"{tuple(row[4 : 4 + ndim])} {dtype}"
    return f"{ndim}-d with {numel} elements {dtype}"


def check_same_tensors(comm: Communicator, named: Sequence[tuple[str, torch.Tensor]],
                       what: str = "parameter") -> None:
    """Raise ValueError on every rank unless all ranks hold the same names, shapes, dtypes."""
    p = comm.world_size
    counts = torch.zeros(p, dtype=torch.int64)
    comm.all_gather(counts, torch.tensor([len(named)], dtype=torch.int64))
    longest = int(counts.max())
    rows = torch.full((longest, _WIDTH), -1, dtype=torch.int64)
    for i, (name, tensor) in enumerate(named):
        rows[i] = torch.tensor(fingerprint(name, tensor))
    everyone = torch.empty(p, longest, _WIDTH, dtype=torch.int64)
    comm.all_gather(everyone, rows)
    differs = (everyone != everyone[0]).any(dim=2).any(dim=0).nonzero()
    if differs.numel() == 0:
        return
    first = int(differs[0])
    names = _gather_names(comm, named[first][0] if first < len(named) else "")
    held = []
    for rank in range(p):
        if first >= int(counts[rank]):
            held.append(f"rank {rank} has no {what} #{first} (it has {int(counts[rank])})")
        else:
            row = everyone[rank, first].tolist()
            held.append(f"rank {rank} has {names[rank]!r} {describe(row)}")
    raise ValueError(
        f"DataParallel: {what} #{first} differs across ranks: {'; '.join(held)}. Every rank "
        f"must build the same model (same code, same constructor arguments) before wrapping it")


def _gather_names(comm: Communicator, name: str) -> list[str]:
    """Every rank's ``name`` (UTF-8, truncated to a fixed width), in rank order."""
    raw = name.encode()[:_NAME_BYTES]
    mine = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    everyone = torch.empty(comm.world_size, _NAME_BYTES, dtype=torch.uint8)
    comm.all_gather(everyone, mine)
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in everyone]


def broadcast_tensors(comm: Communicator, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
    """Overwrite ``tensors`` with ``root``'s values: one broadcast per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for members in groups.values():
            flat = torch.cat([t.reshape(-1) for t in members])
            comm.broadcast(flat, root)
            offset = 0
            for t in members:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

