"""PowerSGD: rank-r gradient compression by one step of power iteration (Vogels, Karimireddy
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

from __future__ import annotations

from dataclasses import dataclass

import torch

from disttrain.comm import Communicator
from disttrain.parallel.buckets import Bucket
from disttrain.parallel.compression.base import Compressor, PendingReduction, ThenFinish

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
    """Rank-``rank`` PowerSGD with error feedback and warm start, per bucket."""

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
