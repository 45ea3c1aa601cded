"""Helpers for tests/test_bench_table.py that ranks import by name (``module:factory``)."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from disttrain.train import DataInfo, build_model


def lenet_failing_on_three_ranks(info: DataInfo) -> nn.Module:
    """LeNet, except that rank 1 of a three-rank run raises while building it: the benchmark
    must report that row (rank 1, the error) and go on with the next one."""
    if dist.is_initialized() and dist.get_world_size() == 3 and dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1 of 3")
    return build_model("lenet", info)
