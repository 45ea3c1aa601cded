"""Evaluation on the held-out split: each data-parallel rank scores a disjoint part, then one
all-reduce of ``(correct, count, loss_sum)`` gives every rank the accuracy of the whole split.

Shards are uneven rather than padded (``pad=False``): a repeated sample would be counted
twice, and the totals are exact whatever the split's size.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.data import Dataset

from disttrain.train.data import fetch, size
from disttrain.train.sampler import DistributedSampler
from disttrain.train.strategies import LossFn, Strategy


def evaluate(strategy: Strategy, dataset: Dataset[Any], loss_fn: LossFn,
             autocast: Callable[[], AbstractContextManager[Any]],
             batch_size: int = 256) -> tuple[float, float]:
    """``(accuracy, mean loss)`` over all of ``dataset``, the same on every rank."""
    sampler = DistributedSampler(size(dataset), strategy.dp_size, strategy.dp_rank,
                                 shuffle=False, pad=False)
    indices = sampler.indices()
    totals = torch.zeros(3, dtype=torch.float64)  # correct, count, loss summed over targets
    module = strategy.module
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            inputs, targets = fetch(dataset, indices[start:start + batch_size])
            with autocast():
                output = module(inputs)
            count = targets.numel()
            totals[0] += (output.argmax(dim=-1) == targets).sum().item()
            totals[1] += count
            totals[2] += loss_fn(output, targets).item() * count
    module.train(was_training)
    if strategy.comm is not None and strategy.dp_size > 1:
        strategy.comm.all_reduce(totals)
    correct, count, loss_sum = totals.tolist()
    return correct / count, loss_sum / count
