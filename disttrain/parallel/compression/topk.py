"""Top-k sparsification with error feedback (Stich, Cordonnier & Jaggi 2018; Lin et al. 2018).

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

from __future__ import annotations

import math

import torch

from disttrain.comm import ALGORITHMS, Communicator
from disttrain.parallel.buckets import Bucket
from disttrain.parallel.compression.base import Compressor, PendingReduction, ThenFinish


def gather_algorithm(algorithm: str | None) -> str | None:
    """The all-reduce algorithm's all_gather namesake (``tree`` has none: use the default)."""
    return algorithm if algorithm in ALGORITHMS["all_gather"] else None


class TopKCompressor(Compressor):
    """Send the ``ratio`` fraction of largest entries per bucket; keep the rest as residual."""

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
