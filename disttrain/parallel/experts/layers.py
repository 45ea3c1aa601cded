"""The experts of one mixture-of-experts layer: all of them on one process (:class:`Experts`),
or this rank's share with the rows of the others' dispatched by all-to-all
(:class:`ExpertParallelExperts`). Both take the same input and give the same output, so the
MoE layer that routes tokens (:mod:`disttrain.train.moe`) does not know which it has.

The input is the layer's kept token rows sorted by expert, with the count of each expert's
rows (``counts[e]``, in expert order); the output is each row's expert output, in the same
order. Expert ``e`` lives on rank ``e // (E/ep)``, so a rank's rows for one destination are
one contiguous block and the sorted rows are already the all-to-all's input::

    rank 0 rows   [ e0 e0 e1 | e2 e3 e3 ]        experts 0, 1 on rank 0; 2, 3 on rank 1
    rank 1 rows   [ e0 e1 e1 | e2 e2 e3 ]
                    to rank 0  to rank 1
    counts ─all-to-all─▶ rank 0 learns: from 0: (2, 1), from 1: (1, 2)
    rows   ─all-to-all─▶ rank 0 holds [ e0 e0 e1 | e0 e1 e1 ]   (source-major)
    regroup by expert:   expert 0 [ e0 e0 e0 ], expert 1 [ e1 e1 e1 e1 ]  (source order)
    run each expert, regroup back source-major, all-to-all back: the combine

Within one expert the rows stay in source-rank order and, inside a source, in the order the
source sorted them: on one process the same expert sees the same rows in the same order
when the batch is the ranks' batches concatenated (the equivalence tests rely on it). Every
expert runs, even on no rows, so every expert parameter has a gradient (zeros when unused),
on one process and on ep ranks alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from disttrain.parallel.experts.ops import EPGroup, all_to_all, exchange_counts
from disttrain.parallel.experts.theory import LayerTraffic


def expert_mlp(d_model: int, d_ff: int) -> nn.Sequential:
    """One expert: the transformer's feed-forward block, Linear → GELU → Linear."""
    return nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))


def _check_counts(rows: torch.Tensor, counts: Sequence[int], n_experts: int) -> list[int]:
    counts = [int(c) for c in counts]
    if len(counts) != n_experts or sum(counts) != rows.shape[0]:
        raise ValueError(f"expected {n_experts} expert row counts summing to the "
                         f"{rows.shape[0]} rows, got {counts}")
    return counts


class Experts(nn.ModuleDict):
    """The ``n_experts`` expert MLPs of one layer, keyed by their global index (``"0"``,
    ``"1"``, …: a parameter's name is the same on one process and on the rank holding it)."""

    def __init__(self, modules: dict[str, nn.Module], n_experts: int) -> None:
        super().__init__(modules)
        self.n_experts = n_experts

    @classmethod
    def build(cls, n_experts: int, d_model: int, d_ff: int) -> Experts:
        return cls({str(e): expert_mlp(d_model, d_ff) for e in range(n_experts)}, n_experts)

    @property
    def indices(self) -> list[int]:
        """The global indices of the experts held here, ascending."""
        return sorted(int(k) for k in self.keys())

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Each row through its expert: ``rows`` sorted by expert, ``counts[e]`` of expert e."""
        pieces = rows.split(_check_counts(rows, counts, self.n_experts))
        return torch.cat([self[str(e)](piece) for e, piece in enumerate(pieces)])


class ExpertParallelExperts(Experts):
    """This rank's ``E/ep`` experts of a layer whose experts are spread over ``group``:
    dispatch (counts, then rows, by all-to-all), the local experts, combine (all-to-all
    back). Built from the full :class:`Experts` by :func:`~disttrain.parallel.experts.
    apply_expert_parallel`, sharing its expert modules (no copy)."""

    def __init__(self, modules: dict[str, nn.Module], n_experts: int, group: EPGroup) -> None:
        super().__init__(modules, n_experts)
        self.group = group
        self.n_local = n_experts // group.size
        self.first = group.rank * self.n_local  # global index of the first local expert
        self._traffic = LayerTraffic()

    @classmethod
    def from_experts(cls, experts: Experts, group: EPGroup) -> ExpertParallelExperts:
        """``experts``' share for this rank of ``group`` (E must divide by the group size)."""
        if experts.n_experts % group.size:
            raise ValueError(f"{experts.n_experts} experts do not divide over ep = "
                             f"{group.size} ranks; choose --ep dividing the number of experts")
        local = experts.n_experts // group.size
        first = group.rank * local
        mine = {str(e): experts[str(e)] for e in range(first, first + local)}
        return cls(mine, experts.n_experts, group)

    def forward(self, rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        counts = _check_counts(rows, counts, self.n_experts)
        size, local, me = self.group.size, self.n_local, self.group.rank
        received = exchange_counts(counts, self.group, rows.device)  # [source][local expert]
        in_splits = [sum(counts[r * local:(r + 1) * local]) for r in range(size)]
        out_splits = [sum(per_source) for per_source in received]
        arrived = all_to_all(rows, self.group, out_splits, in_splits)  # dispatch
        pieces = arrived.split([n for per_source in received for n in per_source])
        outputs = []
        for i in range(local):  # expert i's rows from every source, source by source
            inputs = torch.cat([pieces[s * local + i] for s in range(size)])
            out = self[str(self.first + i)](inputs)
            outputs.append(out.split([received[s][i] for s in range(size)]))
        back = torch.cat([outputs[i][s] for s in range(size) for i in range(local)])
        self._traffic += LayerTraffic(sum(in_splits) - in_splits[me],
                                      sum(out_splits) - out_splits[me], 1)
        return all_to_all(back, self.group, in_splits, out_splits)  # combine

    def drain_traffic(self) -> LayerTraffic:
        """Rows sent and received by the forwards since the last drain (then reset)."""
        traffic, self._traffic = self._traffic, LayerTraffic()
        return traffic
