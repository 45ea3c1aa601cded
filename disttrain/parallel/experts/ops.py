"""The communication of expert parallelism: the all-to-all that carries token rows to their
experts' ranks and back, as an autograd function, and the exchange of counts before it.

An all-to-all with uneven splits is its own transpose: the rows rank i sent to rank j come
back from rank j to rank i when the splits are swapped. So the backward of each all-to-all
is the same collective with ``input_split_sizes`` and ``output_split_sizes`` exchanged::

    forward                                  backward
    rank 0 rows [ a0 | b0 ]   ─┐   ┌─▶ [ a0 | a1 ]  rank 0     grad [ a0 | a1 ] ─▶ [ a0 | b0 ]
    rank 1 rows [ a1 | b1 ]   ─┴───┴─▶ [ b0 | b1 ]  rank 1     grad [ b0 | b1 ] ─▶ [ a1 | b1 ]
                 to 0  to 1                 from 0  from 1

Row counts differ from step to step (they are the router's choices), so before the rows move
each rank tells every other how many rows of each of its experts to expect: one all-to-all
of ``E`` int64 counts (``E/ep`` to each rank). The backward needs no counts: it reuses the
forward's splits.

Every call goes through the :class:`~disttrain.comm.Communicator` (its bytes are counted by
``comm.stats``), with the algorithm of :class:`EPGroup` (None: the communicator's default).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from disttrain.comm import Communicator


@dataclass(frozen=True)
class EPGroup:
    """The expert-parallel group: its communicator and the algorithm its collectives use."""

    comm: Communicator
    algorithm: str | None = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.world_size

    def all_to_all(self, rows: torch.Tensor, out_splits: Sequence[int],
                   in_splits: Sequence[int]) -> torch.Tensor:
        """Rows ``in_splits[j]`` of ``rows`` go to rank j; ``out_splits[j]`` rows come from
        rank j, concatenated in rank order."""
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        self.comm.all_to_all(out, rows.contiguous(), list(out_splits), list(in_splits),
                             algorithm=self.algorithm)
        return out


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with ``(out_splits, in_splits)``; backward: the swapped one."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, group: EPGroup, out_splits: list[int],
                in_splits: list[int]) -> torch.Tensor:
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        return group.all_to_all(rows, out_splits, in_splits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return ctx.group.all_to_all(grad, in_splits, out_splits), None, None, None


def all_to_all(rows: torch.Tensor, group: EPGroup, out_splits: Sequence[int],
               in_splits: Sequence[int]) -> torch.Tensor:
    """Differentiable all-to-all of ``rows`` along dim 0 (see the module docstring)."""
    result: torch.Tensor = _AllToAll.apply(rows, group, list(out_splits), list(in_splits))
    return result


def exchange_counts(counts: Sequence[int], group: EPGroup, device: torch.device
                    ) -> list[list[int]]:
    """Each rank's rows for each of this rank's experts: ``received[s][i]`` rows come from
    rank s for local expert i. ``counts`` is this rank's kept rows per global expert
    (experts ``r·E/ep … (r+1)·E/ep − 1`` live on rank r)."""
    local = len(counts) // group.size
    mine = torch.tensor(list(counts), dtype=torch.int64, device=device)
    received = group.all_to_all(mine, [local] * group.size, [local] * group.size)
    flat = received.tolist()
    return [flat[s * local:(s + 1) * local] for s in range(group.size)]
