"""Evaluation on the held-out split: each shard (``strategy.eval_shards``, by default one per
data-parallel rank) is scored where the strategy holds the output, then
``strategy.combine_scores`` gives every rank the totals
``(correct, count, loss_sum)`` of the whole split (one all-reduce for data parallelism; the
last stage shares its scores in a pipeline).

Shards are uneven rather than padded (``pad=False``): a repeated sample would be counted
twice, and the totals are exact whatever the split's size. Every rank cuts its shard into
the *same number* of batches, because some strategies' forward is a collective (ZeRO-3
gathers each layer's parameters): a rank that ran one batch fewer would leave the others
waiting. Batches hold at least ``strategy.eval_min_rows`` samples (a pipeline cuts each
into its micro-batches).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.data import Dataset

from disttrain.train.batches import Batch, scores
from disttrain.train.data import fetch, size
from disttrain.train.device import to_device
from disttrain.train.sampler import DistributedSampler
from disttrain.train.strategies import LossFn
from disttrain.train.strategies.base import Autocast


class Scorer(Protocol):
    """What :func:`evaluate` needs: a strategy (:class:`~disttrain.train.strategies.Strategy`
    has every member), or a parameter server's final model (:mod:`disttrain.train.ps_server`)."""

    @property
    def eval_shards(self) -> int: ...

    @property
    def eval_shard(self) -> int: ...

    @property
    def eval_min_rows(self) -> int: ...

    @property
    def collective_eval(self) -> bool: ...

    def before_eval(self) -> None: ...

    def eval_modules(self) -> list[nn.Module]: ...

    def predict(self, inputs: Any) -> torch.Tensor | None: ...

    def combine_scores(self, totals: torch.Tensor) -> torch.Tensor: ...


def batch_count(total: int, shards: int, batch_size: int, min_rows: int) -> int:
    """How many batches every rank cuts its shard of ``total`` samples into: enough that none
    exceeds ``batch_size``, few enough that the smallest shard's have ``min_rows`` each."""
    largest, smallest = math.ceil(total / shards), total // shards
    if 0 < smallest < min_rows:
        raise ValueError(f"the held-out split gives a data-parallel shard {smallest} samples, "
                         f"fewer than the {min_rows} micro-batches each evaluation batch is cut "
                         f"into; use fewer micro-batches or a larger test split")
    count = max(1, math.ceil(largest / batch_size))
    return max(1, min(count, smallest // min_rows)) if smallest else count


def evaluate(strategy: Scorer, dataset: Dataset[Any], loss_fn: LossFn, autocast: Autocast,
             batch_size: int = 256, device: torch.device | None = None,
             dtype: torch.dtype | None = None,
             align: Callable[[Batch], Batch] | None = None) -> tuple[float, float]:
    """``(accuracy, mean loss)`` over all of ``dataset``, the same on every rank (batches
    moved to ``device``, the CPU by default, float inputs cast to ``dtype`` if given;
    ``align``: what the loop does to each fetched batch, :func:`~.batches.batch_aligner`).
    Targets of -100 are not scored; a model's own loss (given labels) is the loss."""
    device = device if device is not None else torch.device("cpu")
    total = size(dataset)
    sampler = DistributedSampler(total, strategy.eval_shards, strategy.eval_shard,
                                 shuffle=False, pad=False)
    indices = torch.as_tensor(sampler.indices(), dtype=torch.long)
    batches = batch_count(total, strategy.eval_shards, batch_size, strategy.eval_min_rows)
    totals = torch.zeros(3, dtype=torch.float64)  # correct, count, loss summed over targets
    align = align if align is not None else (lambda batch: batch)
    strategy.before_eval()
    modules = strategy.eval_modules()
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        with torch.no_grad():
            for part in torch.tensor_split(indices, batches):
                if len(part) == 0 and not strategy.collective_eval:
                    continue
                inputs, targets = to_device(align(fetch(dataset, part)), device, dtype)
                with autocast():
                    output = strategy.predict(inputs)
                if output is None or targets.numel() == 0:
                    continue
                totals += torch.tensor(scores(output, targets, loss_fn), dtype=torch.float64)
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)
    correct, count, loss_sum = strategy.combine_scores(totals).tolist()
    return correct / count, loss_sum / count
