"""DistributedSampler: each data-parallel rank draws a disjoint shard of the dataset's indices.

Every rank computes the same permutation (seeded by ``seed + epoch``, never by rank) and keeps
every ``world_size``-th position, starting at its own rank::

    permutation   p0 p1 p2 p3 p4 p5 p6 p7 p8 p9      (10 samples, world_size 4)
    rank 0        p0          p4          p8
    rank 1           p1          p5          p9
    rank 2              p2          p6          p0   ← padding repeats the head
    rank 3                 p3          p7          p1

Strided shards make data parallelism exact: batch k of size b on every rank together hold
positions ``[k·b·N, (k+1)·b·N)`` of the permutation, which is batch k of size ``b·N`` in a
single process with the same seed. The remainder that does not divide by ``world_size`` is
either padded (repeating the permutation's head, so every rank has the same count), dropped
(``drop_last=True``), or left uneven (``pad=False``: ranks differ by at most one; use it for
evaluation, where a repeated sample would be counted twice).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sized

import torch


class DistributedSampler:
    """Indices of this rank's shard, reshuffled each epoch by :meth:`set_epoch`."""

    def __init__(self, dataset: Sized | int, world_size: int = 1, rank: int = 0, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 pad: bool = True) -> None:
        size = dataset if isinstance(dataset, int) else len(dataset)
        if isinstance(size, bool) or size < 0:
            raise ValueError(f"the dataset size must be a non-negative int, got {size!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int ≥ 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if drop_last and size < world_size:
            raise ValueError(f"drop_last=True with {size} samples and {world_size} ranks leaves "
                             f"every rank empty; use fewer ranks or pad instead")
        self.dataset_size = size
        self.world_size, self.rank = world_size, rank
        self.shuffle, self.seed = shuffle, seed
        self.drop_last, self.pad = drop_last, pad
        self.epoch = 0
        self.start = 0  # position in this rank's shard to resume from (see set_start)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's permutation (call before iterating; all ranks the same epoch)."""
        if epoch < 0:
            raise ValueError(f"epoch must be ≥ 0, got {epoch}")
        self.epoch = epoch
        self.start = 0

    def set_start(self, start: int) -> None:
        """Skip the first ``start`` indices of this epoch's shard (resuming mid-epoch)."""
        if not 0 <= start <= len(self):
            raise ValueError(f"start must be in [0, {len(self)}], got {start}")
        self.start = start

    def total_size(self) -> int:
        """How many permutation positions the ranks share out (after drop or padding)."""
        n, p = self.dataset_size, self.world_size
        if self.drop_last:
            return n - n % p
        if self.pad:
            return -(-n // p) * p
        return n

    def __len__(self) -> int:
        """The number of indices this rank yields per epoch (ignoring ``start``)."""
        total, p = self.total_size(), self.world_size
        return total // p + (1 if self.rank < total % p else 0)

    def permutation(self) -> torch.Tensor:
        """The epoch's order of all dataset indices, identical on every rank."""
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def indices(self) -> torch.Tensor:
        """This rank's shard for the current epoch, from position ``start`` on."""
        order = self.permutation()
        total = self.total_size()
        if total > self.dataset_size:  # pad by repeating the head (cyclically if needed)
            repeats = -(-total // max(self.dataset_size, 1))
            order = order.repeat(repeats)[:total] if self.dataset_size else order
        order = order[:total]
        return order[self.rank::self.world_size][self.start:]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def batches(self, batch_size: int, count: int) -> Iterator[tuple[int, torch.Tensor]]:
        """``(epoch, indices)`` of the next ``count`` batches of ``batch_size`` indices of
        this rank's shard, from the current position (``epoch``, ``start``) on and through
        the later epochs; an epoch's last indices that do not fill a batch are skipped. It
        walks a copy: this sampler's own position does not move."""
        if batch_size < 1 or len(self) < batch_size:
            raise ValueError(f"batch_size must be in [1, {len(self)}] (this rank's shard), "
                             f"got {batch_size}")
        walker = copy.copy(self)
        while count > 0:
            shard = walker.indices()
            for k in range(min(len(shard) // batch_size, count)):
                yield walker.epoch, shard[k * batch_size:(k + 1) * batch_size]
                count -= 1
            walker.set_epoch(walker.epoch + 1)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(int(state["epoch"]))
        self.set_start(int(state["start"]))
