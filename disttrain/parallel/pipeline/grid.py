"""The pp × dp rank grid: pipelines of ``pp_size`` stages, replicated ``dp_size`` times.

Rank ``r`` is stage ``r % pp_size`` of pipeline replica ``r // pp_size``; the ranks of one
pipeline are contiguous. For pp = 2, dp = 2::

              stage 0   stage 1
    replica 0  rank 0 →  rank 1      ← pipeline group (activations and gradients, P2P)
    replica 1  rank 2 →  rank 3
                  ↕         ↕
             dp group   dp group     ← gradient all-reduce among copies of one stage

Each replica trains on its own share of the global batch; after the pipeline step the
copies of each stage average their gradients over their dp group, which makes the update
equal to the full-batch update (for equal shares and a mean loss).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.pipeline import partition as part


@dataclass(frozen=True)
class PipelineGrid:
    """This rank's place in the grid and its two sub-communicators."""

    pp_size: int
    dp_size: int
    stage: int  # = pp_rank
    dp_rank: int
    pp_comm: Communicator | None  # None when pp_size == 1 (no pipeline neighbours)
    dp_comm: Communicator | None  # None when dp_size == 1 (nothing to average)
    world: Communicator


def make_grid(comm: Communicator, pp_size: int | None = None) -> PipelineGrid:
    """Split ``comm``'s ranks into pipelines of ``pp_size`` stages (default: all ranks form
    one pipeline). Every rank must call this with the same ``pp_size``: groups are created
    in the same order everywhere (all pipeline groups, then all dp groups)."""
    world = comm.world_size
    pp = world if pp_size is None else pp_size
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1 or world % pp:
        raise ValueError(f"pp_size={pp_size!r} must be a positive divisor of the world size "
                         f"{world} (pipelines of pp_size stages, world_size/pp_size replicas)")
    check_agreement(comm, [pp], "pp_size")  # groups built from different sizes would hang
    dp = world // pp
    stage, dp_rank = comm.rank % pp, comm.rank // pp
    pp_comm = comm if dp == 1 else None
    dp_comm = comm if pp == 1 else None
    if pp > 1 and dp > 1:
        for replica in range(dp):
            group = comm.new_group([replica * pp + s for s in range(pp)])
            pp_comm = group if group is not None else pp_comm
        for s in range(pp):
            group = comm.new_group([replica * pp + s for replica in range(dp)])
            dp_comm = group if group is not None else dp_comm
    return PipelineGrid(pp, dp, stage, dp_rank, pp_comm if pp > 1 else None,
                        dp_comm if dp > 1 else None, comm)


def all_reduce_gradients(parameters: Iterable[nn.Parameter], comm: Communicator) -> None:
    """Average gradients over ``comm`` in one flat all-reduce (missing gradients count as
    zero, so every rank contributes the same layout)."""
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    comm.all_reduce(flat, "avg")
    offset = 0
    for p in params:
        n = p.numel()
        averaged = flat[offset:offset + n].view_as(p)
        if p.grad is None:
            p.grad = averaged.clone()
        else:
            p.grad.copy_(averaged)
        offset += n


def check_agreement(comm: Communicator, values: Sequence[int], what: str) -> None:
    """Raise on every rank if the ranks of ``comm`` disagree about ``values`` (e.g. stage
    count, micro-batches, balance), which would otherwise hang or mix up tensors later."""
    mine = torch.tensor(list(values), dtype=torch.int64)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = torch.zeros(comm.world_size, dtype=torch.int64)
    comm.all_gather(sizes, size)
    width = int(sizes.max())
    padded = torch.full((width,), -1, dtype=torch.int64)
    padded[:mine.numel()] = mine
    table = torch.zeros(comm.world_size * width, dtype=torch.int64)
    comm.all_gather(table, padded)
    rows = [tuple(row[:int(n)]) for row, n in
            zip(table.view(comm.world_size, width).tolist(), sizes.tolist())]
    if any(row != rows[0] for row in rows):
        listing = "; ".join(f"rank {comm.global_ranks[r]}: {list(row)}"
                            for r, row in enumerate(rows))
        raise ValueError(f"the ranks disagree about {what} ({listing}); every rank must be "
                         f"started with the same settings and the same model")


def agreed_balance(comm: Communicator, layers: Sequence[nn.Module], num_stages: int,
                   partition: str | Sequence[int], sample: torch.Tensor | None,
                   settings: Sequence[int], what: str) -> tuple[int, ...]:
    """The balance every rank of ``comm`` will use. First the ranks check that they agree on
    ``settings``, the partition method and the model (parameter count of each layer), so a
    mismatch is an error on every rank instead of a hang; then each chooses the balance
    from identical inputs (``"time"`` averages the ranks' timings first)."""
    kind = ["params", "time"].index(partition) if isinstance(partition, str) and partition in (
        "params", "time") else 2
    explicit = list(partition) if kind == 2 and not isinstance(partition, str) else []
    check_agreement(comm, [*settings, kind, len(layers), *map(int, part.param_costs(layers)),
                           *explicit], f"{what} (settings, partition, layer sizes)")

    def average(costs: list[float]) -> list[float]:
        t = torch.tensor(costs, dtype=torch.float64)
        comm.all_reduce(t, "avg")  # bit-identical on every rank
        return t.tolist()

    balance = part.choose_balance(layers, num_stages, partition, sample, average)
    part.check_no_shared_parameters(layers, balance)
    return balance
