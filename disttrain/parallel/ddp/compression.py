"""Gradient compression for DataParallel: one interface, four compressors, one registry.

=========  ==============================================  =======================
name       what goes on the wire per bucket of n entries    bytes vs fp32 all-reduce
=========  ==============================================  =======================
none       n fp32 values, all-reduced                       1
fp16/bf16  n 16-bit values, all-reduced                     1/2
topk       k = ratio·n (value, int32 index) pairs, gathered  ≈ p·ratio (p ranks)
powersgd   (rows + cols)·r per matrix, all-reduced twice     ≈ r(n+m)/(nm) per layer
=========  ==============================================  =======================

A :class:`Compressor` plays the role of Horovod's ``Compression`` class or a torch DDP
communication hook: DataParallel hands it a full bucket as soon as the bucket's gradients
are ready, and gets back a handle; ``handle.wait()`` (called at the end of backward, in
bucket order on every rank) leaves the average over ranks in ``bucket.flat``::

    bucket.flat ─▶ start(): compress, launch async collective(s) ─▶ handle
                                   ... backward goes on ...
    handle.wait(): finish collective(s), decompress ─▶ bucket.flat = mean over ranks

Rules every compressor follows, because the Communicator runs collectives in call order:
``start`` and ``wait`` issue the same collectives, with the same sizes, on every rank.
Compressors keep per-bucket state (error feedback, warm starts) keyed by ``bucket.index``:
use one compressor object per model.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from disttrain.comm import ALGORITHMS, Communicator
from disttrain.parallel.ddp.buckets import Bucket


class PendingReduction(Protocol):
    """What ``start`` returns; ``wait`` completes the averaging (a comm ``Work`` is one)."""

    def wait(self) -> None: ...


class Compressor(ABC):
    """Averages a bucket over ranks, compressing what goes on the wire."""

    name = "abstract"

    @abstractmethod
    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        """Launch the (asynchronous) reduction of ``bucket.flat``; return its handle."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ThenFinish:
    """Wait for some comm works, then run ``finish`` once (the decompress step)."""

    def __init__(self, works: Sequence[PendingReduction | None],
                 finish: Callable[[], None]) -> None:
        self._works, self._finish, self._done = works, finish, False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            if work is not None:
                work.wait()
        self._finish()
        self._done = True


class NoCompression(Compressor):
    """Plain all-reduce of the bucket with ``op="avg"``: the division by the world size
    happens on the communicator's progress thread, still overlapped with backward."""

    name = "none"

    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        work = comm.all_reduce(bucket.flat, "avg", algorithm=algorithm, async_op=True)
        assert work is not None  # async_op=True always returns a handle
        return work


class CastCompressor(Compressor):
    """Send gradients as ``dtype`` (``torch.float16`` or ``torch.bfloat16``).

    16-bit gradient compression: cast down, all-reduce, cast up (2× fewer bytes than fp32).

    Like torch's ``fp16_compress_hook`` and Horovod's ``Compression.fp16``. The bucket is divided
    by the world size *before* the cast, so the sum over ranks stays in the range of the
    16-bit type (fp16 overflows above 65504; bf16 keeps fp32's range with 8 bits of mantissa).
    Compression here is :meth:`CastCompressor.compress` / :meth:`CastCompressor.decompress`
    around one all-reduce, the Horovod shape of the interface.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"CastCompressor dtype must be torch.float16 or torch.bfloat16, "
                             f"got {dtype}")
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def compress(self, tensor: torch.Tensor, world_size: int) -> torch.Tensor:
        """The payload: ``tensor / world_size`` in the 16-bit dtype (a new tensor)."""
        payload = tensor.to(self.dtype, copy=True)
        return payload.div_(world_size) if world_size > 1 else payload

    @staticmethod
    def decompress(payload: torch.Tensor, out: torch.Tensor) -> None:
        """Write the reduced payload back into ``out`` in its own dtype."""
        out.copy_(payload)

    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        payload = self.compress(bucket.flat, comm.world_size)
        work = comm.all_reduce(payload, "sum", algorithm=algorithm, async_op=True)
        return ThenFinish([work], lambda: self.decompress(payload, bucket.flat))

    def __repr__(self) -> str:
        return f"CastCompressor({self.dtype})"


def gather_algorithm(algorithm: str | None) -> str | None:
    """The all-reduce algorithm's all_gather namesake (``tree`` has none: use the default)."""
    return algorithm if algorithm in ALGORITHMS["all_gather"] else None


class TopKCompressor(Compressor):
    """Send the ``ratio`` fraction of largest entries per bucket; keep the rest as residual.

    Top-k sparsification with error feedback (Stich, Cordonnier & Jaggi 2018; Lin et al. 2018).

    Each rank keeps only the k largest-magnitude entries of its bucket (k = ⌈ratio·n⌉) and
    sends them as (value, index) pairs; whatever it did not send stays in a local *residual*
    that is added to the next step's gradient, so no gradient is ever lost, only delayed::

        acc      = grad + residual                 local, n entries
        sent     = top_k(|acc|)                    k values + k int32 indices
        residual = acc − sent                      kept on this rank
        all_gather(values), all_gather(indices)    p·k pairs on every rank
        grad     = scatter_add(all pairs) / p      dense again, the average of what was sent

    Different ranks pick different indices, so the pairs are all-gathered rather than
    all-reduced. Bytes per rank with a ring: (p−1)·k·(value + 4) instead of 2(p−1)/p·n·value,
    that is a fraction p·ratio of the uncompressed bytes for fp32 (values and indices both 4
    bytes): it pays off only when ratio ≪ 1/p.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, error_feedback: bool = True) -> None:
        if not (isinstance(ratio, (int, float)) and 0 < ratio <= 1):
            raise ValueError(f"top-k ratio must be in (0, 1] (the fraction of entries sent), "
                             f"got {ratio!r}")
        self.ratio = float(ratio)
        self.error_feedback = error_feedback
        self.residuals: dict[int, torch.Tensor] = {}

    def k_for(self, numel: int) -> int:
        """Entries sent for a bucket of ``numel`` entries (at least one)."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def compress(self, acc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest-magnitude entries of ``acc``: (values, int32 indices)."""
        _, indices = acc.abs().topk(self.k_for(acc.numel()), sorted=False)
        return acc[indices], indices.to(torch.int32)

    def _residual(self, bucket: Bucket) -> torch.Tensor:
        residual = self.residuals.get(bucket.index)
        if residual is None or residual.shape != bucket.flat.shape:
            residual = self.residuals[bucket.index] = torch.zeros_like(bucket.flat)
        return residual

    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        flat, p = bucket.flat, comm.world_size
        residual = self._residual(bucket) if self.error_feedback else None
        if residual is not None:
            flat.add_(residual)  # acc = grad + what earlier steps did not send
        values, indices = self.compress(flat)
        if residual is not None:
            residual.copy_(flat)
            residual[indices.long()] = 0
        all_values = values.new_empty(p * values.numel())
        all_indices = indices.new_empty(p * indices.numel())
        name = gather_algorithm(algorithm)
        works = [comm.all_gather(all_values, values, algorithm=name, async_op=True),
                 comm.all_gather(all_indices, indices, algorithm=name, async_op=True)]

        def decompress() -> None:
            flat.zero_()
            flat.index_add_(0, all_indices.long(), all_values)
            if p > 1:
                flat.div_(p)

        return ThenFinish(works, decompress)

    def __repr__(self) -> str:
        return f"TopKCompressor(ratio={self.ratio}, error_feedback={self.error_feedback})"


_Views = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class _Matrix:
    offset: int
    rows: int
    cols: int
    rank: int


@dataclass
class _BucketState:
    matrices: list[_Matrix]
    vectors: list[tuple[int, int]]  # (offset, numel) sent uncompressed
    p_buf: torch.Tensor  # P factors, then the uncompressed entries
    q_buf: torch.Tensor  # Q factors (kept: the warm start of the next step)
    error: torch.Tensor | None
    numel: int


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with error feedback and warm start, per bucket.

    PowerSGD: rank-r gradient compression by one step of power iteration (Vogels, Karimireddy
    & Jaggi, NeurIPS 2019).

    Each gradient of a layer is viewed as a matrix M (n × m: rows = output dim); instead of M,
    ranks exchange two thin factors, with a Q (m × r) that is *warm-started* from the previous
    step and the *error* of the approximation fed back into the next step::

        M  = grad + error                        local
        P  = M Q            all_reduce(P) / p    n × r     (first collective)
        P  = orthogonalize(P)                    QR, identical on every rank
        Q  = Mᵀ P           all_reduce(Q) / p    m × r     (second collective)
        grad  = P Qᵀ                             the rank-r approximation of the mean gradient
        error = M − P Qᵀ                         kept on this rank

    Bytes per matrix fall from n·m to (n + m)·r. Vectors (biases, norms) and matrices too small
    to gain are sent uncompressed, packed behind the P factors in the first collective. The
    first collective overlaps backward; the second runs when DataParallel waits for the bucket.
    """

    name = "powersgd"

    def __init__(self, rank: int = 2, *, error_feedback: bool = True, warm_start: bool = True,
                 seed: int = 0) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive int (e.g. 1, 2, 4), got {rank!r}")
        self.rank = rank
        self.error_feedback = error_feedback
        self.warm_start = warm_start
        self.seed = seed
        self.states: dict[int, _BucketState] = {}

    # ------------------------------------------------------------------ layout
    def plan(self, bucket: Bucket) -> tuple[list[_Matrix], list[tuple[int, int]]]:
        """Which members are compressed (as rows × cols matrices) and which are sent as is."""
        matrices, vectors = [], []
        for offset, shape in zip(bucket.offsets, bucket.shapes):
            numel = shape.numel()
            rows = shape[0] if len(shape) >= 2 else 1
            cols = numel // rows if rows else 0
            r = min(self.rank, rows, cols)
            if len(shape) >= 2 and (rows + cols) * r < rows * cols:
                matrices.append(_Matrix(offset, rows, cols, r))
            elif numel:
                vectors.append((offset, numel))
        return matrices, vectors

    def _state(self, bucket: Bucket) -> _BucketState:
        state = self.states.get(bucket.index)
        if state is not None and state.numel == bucket.flat.numel():
            return state
        matrices, vectors = self.plan(bucket)
        flat = bucket.flat
        p_numel = sum(m.rows * m.rank for m in matrices) + sum(n for _, n in vectors)
        q_buf = flat.new_empty(sum(m.cols * m.rank for m in matrices))
        error = torch.zeros_like(flat) if self.error_feedback else None
        state = _BucketState(matrices, vectors, flat.new_empty(p_numel), q_buf, error,
                             flat.numel())
        self._draw_q(bucket.index, state)
        self.states[bucket.index] = state
        return state

    def _draw_q(self, index: int, state: _BucketState) -> None:
        """Random normal Q, the same on every rank (same seed, same bucket index)."""
        gen = torch.Generator().manual_seed(self.seed * 100_003 + index)
        values = torch.randn(state.q_buf.numel(), generator=gen, dtype=torch.float64)
        state.q_buf.copy_(values)

    @staticmethod
    def _views(state: _BucketState, flat: torch.Tensor) -> list[_Views]:
        """(offset, M, P, Q) views for each compressed matrix."""
        views, p_at, q_at = [], 0, 0
        for m in state.matrices:
            mat = flat[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
            p = state.p_buf[p_at : p_at + m.rows * m.rank].view(m.rows, m.rank)
            q = state.q_buf[q_at : q_at + m.cols * m.rank].view(m.cols, m.rank)
            views.append((m.offset, mat, p, q))
            p_at, q_at = p_at + m.rows * m.rank, q_at + m.cols * m.rank
        return views

    # ------------------------------------------------------------------ reduction
    def start(self, bucket: Bucket, comm: Communicator,
              algorithm: str | None) -> PendingReduction:
        flat = bucket.flat
        state = self._state(bucket)
        if not self.warm_start:
            self._draw_q(bucket.index, state)
        if state.error is not None:
            flat.add_(state.error)  # M = grad + error, in the bucket itself
        views = self._views(state, flat)
        for _, mat, p, q in views:
            torch.matmul(mat, q, out=p)
        tail = sum(m.rows * m.rank for m in state.matrices)
        for offset, numel in state.vectors:
            state.p_buf[tail : tail + numel].copy_(flat[offset : offset + numel])
            tail += numel
        work = comm.all_reduce(state.p_buf, "avg", algorithm=algorithm, async_op=True)
        return ThenFinish([work], lambda: self._finish(state, flat, views, comm, algorithm))

    def _finish(self, state: _BucketState, flat: torch.Tensor,
                views: list[_Views], comm: Communicator,
                algorithm: str | None) -> None:
        for _, mat, p, q in views:
            p.copy_(torch.linalg.qr(p, mode="reduced").Q)
            torch.matmul(mat.t(), p, out=q)
        if views:
            comm.all_reduce(state.q_buf, "avg", algorithm=algorithm)
        for offset, mat, p, q in views:
            approx = p @ q.t()
            if state.error is not None:  # error = M − P Qᵀ, what this rank did not get across
                err = state.error[offset : offset + mat.numel()].view_as(mat)
                torch.sub(mat, approx, out=err)
            mat.copy_(approx)
        tail = sum(m.rows * m.rank for m in state.matrices)
        for offset, numel in state.vectors:
            flat[offset : offset + numel].copy_(state.p_buf[tail : tail + numel])
            tail += numel

    def __repr__(self) -> str:
        return (f"PowerSGDCompressor(rank={self.rank}, error_feedback={self.error_feedback}, "
                f"warm_start={self.warm_start})")


COMPRESSORS = ("none", "fp16", "bf16", "topk", "powersgd")


def make_compressor(name: str, *, topk_ratio: float = 0.01, powersgd_rank: int = 2,
                    seed: int = 0) -> Compressor:
    """A fresh compressor by name (what ``--compression`` on the command line maps to)."""
    if name == "none":
        return NoCompression()
    if name == "fp16":
        return CastCompressor(torch.float16)
    if name == "bf16":
        return CastCompressor(torch.bfloat16)
    if name == "topk":
        return TopKCompressor(topk_ratio)
    if name == "powersgd":
        return PowerSGDCompressor(powersgd_rank, seed=seed)
    raise ValueError(f"unknown compression {name!r}; choose one of: {', '.join(COMPRESSORS)}")


__all__ = [
    "COMPRESSORS",
    "CastCompressor",
    "Compressor",
    "NoCompression",
    "PendingReduction",
    "PowerSGDCompressor",
    "ThenFinish",
    "TopKCompressor",
    "make_compressor",
]
