"""The pipeline's collectives over the mesh (:mod:`disttrain.parallel.mesh`): the ranks agree on
the split before any stage is built, and the copies of a stage in a pp × dp grid average
their gradients after each step.

Each replica trains on its own share of the global batch; after the pipeline step the
copies of each stage average their gradients over their dp group, which makes the update
equal to the full-batch update (for equal shares and a mean loss).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.mesh import check_agreement
from disttrain.parallel.pipeline import partition as part
from disttrain.parallel.pipeline.link import DTYPES


def all_reduce_gradients(parameters: Iterable[nn.Parameter], comm: Communicator, *,
                         failed: bool = False) -> list[int]:
    """Average gradients over ``comm`` in one flat all-reduce, unless a rank reports that it
    ``failed``; returns the ranks of ``comm`` that did (then no gradient is changed). Every
    rank calls it once per step, also a failed one, so no rank waits in vain::

        [ grad 0 | grad 1 | ... | has 0, has 1, ... | failed 0, ..., failed n−1 ]

    A rank without a gradient for a parameter contributes zeros and ``has = 0``; a failed
    rank contributes only its ``failed`` flag. Averaged, ``has > 0`` iff some rank has that
    gradient (the mean of 0/1 flags is positive exactly when their max is 1): a parameter
    no rank has a gradient for keeps ``.grad = None``, as in single-process training, so
    momentum and weight decay leave it alone."""
    params = [p for p in parameters if p.requires_grad]
    dtype = (functools.reduce(torch.promote_types, (p.dtype for p in params)) if params
             else torch.float32)  # the gradients' own dtype: no wider on the wire
    device = params[0].device if params else torch.device("cpu")
    pieces = [torch.zeros(p.numel(), dtype=dtype, device=device) if failed or p.grad is None
              else p.grad.reshape(-1).to(dtype) for p in params]
    has = [0.0 if failed or p.grad is None else 1.0 for p in params]
    flags = [0.0] * comm.world_size
    flags[comm.rank] = 1.0 if failed else 0.0
    flat = torch.cat([*pieces, torch.tensor(has + flags, dtype=dtype, device=device)])
    comm.all_reduce(flat, "avg")
    reported = flat[-comm.world_size:].tolist()
    failures = [r for r, flag in enumerate(reported) if flag > 0]
    if failures:
        return failures
    offset, has_any = 0, flat[-comm.world_size - len(params):-comm.world_size].tolist()
    for p, anyone in zip(params, has_any):
        n = p.numel()
        averaged = flat[offset:offset + n].view_as(p)
        offset += n
        if anyone <= 0:
            continue  # no rank has this gradient: leave it None
        if p.grad is None:
            p.grad = averaged.to(p.dtype).clone()
        else:
            p.grad.copy_(averaged)
    return []


def agreed_balance(comm: Communicator, layers: Sequence[nn.Module], num_stages: int,
                   partition: str | Sequence[int], sample: torch.Tensor | None,
                   settings: Sequence[int], what: str) -> tuple[int, ...]:
    """The balance every rank of ``comm`` will use. First the ranks check that they agree on
    ``settings``, the partition method and the model (parameter count of each layer), and
    for ``"time"`` on the sample batch, so a mismatch is an error on every rank instead of
    a hang; then each chooses the balance from identical inputs (``"time"`` averages the
    ranks' timings first)."""
    kind = ["params", "time"].index(partition) if isinstance(partition, str) and partition in (
        "params", "time") else 2
    explicit = list(partition) if kind == 2 and not isinstance(partition, str) else []
    check_agreement(comm, [*settings, kind, len(layers), *map(int, part.param_costs(layers)),
                           *explicit], f"{what} (settings, partition, layer sizes)")
    if partition == "time":
        balance = part.balance_by_cost(_agreed_time_costs(comm, layers, num_stages, sample),
                                       num_stages)
    else:
        balance = part.choose_balance(layers, num_stages, partition)
    part.check_no_shared_parameters(layers, balance)
    return balance


def _sample_signature(sample: torch.Tensor | None) -> list[int]:
    """Given or not, then dtype and shape: what the ranks' samples must share."""
    if not isinstance(sample, torch.Tensor):
        return [0]
    return [1, DTYPES.index(sample.dtype) if sample.dtype in DTYPES else -1, sample.dim(),
            *sample.shape]


def _agreed_time_costs(comm: Communicator, layers: Sequence[nn.Module], num_stages: int,
                       sample: torch.Tensor | None) -> list[float]:
    """Each layer's forward + backward time, averaged over the ranks. Every rank takes part
    in the average even when its own timing failed (with a flag instead of timings), so the
    others raise too instead of waiting for it."""
    check_agreement(comm, _sample_signature(sample), "the sample batch of partition='time' "
                    "(1 if given, then dtype code, dims, shape)", error=part.PartitionError,
                    fix="pass the same sample=<an input batch> on every rank")
    if sample is None:
        raise part.PartitionError("partition='time' times each layer on a sample batch: pass "
                                  "sample=<an input batch> on every rank")
    part.check_stages(len(layers), num_stages)
    failure: Exception | None = None
    try:
        costs = part.time_costs(layers, sample)
    except Exception as exc:
        failure, costs = exc, [0.0] * len(layers)
    flags = [1.0 if failure is not None and r == comm.rank else 0.0
             for r in range(comm.world_size)]
    t = torch.tensor(costs + flags, dtype=torch.float64)
    comm.all_reduce(t, "avg")  # bit-identical on every rank
    if failure is not None:
        raise failure
    failed = [comm.global_ranks[r] for r, f in enumerate(t[len(costs):].tolist()) if f > 0]
    if failed:
        raise part.PartitionError(f"timing the layers for partition='time' failed on rank(s) "
                                  f"{failed} (see their errors)")
    return t[:len(costs)].tolist()
