"""ZeRO (Rajbhandari et al. 2020): shard optimizer state (stage 1), gradients (stage 2) and
parameters (stage 3) over the ranks of a Communicator. See docs/zero.md."""

from collections.abc import Callable

from disttrain.parallel.zero.checkpoint import consolidate, load, save
from disttrain.parallel.zero.config import OptimizerFactory, ZeroConfig
from disttrain.parallel.zero.memory import (
    ModelStateBytes,
    formula,
    measure,
    measure_module,
    zero_formula,
    zero_measured,
)
from disttrain.parallel.zero.protocol import ZeroWrapper
from disttrain.parallel.zero.sharding import Piece, ShardLayout, read_plan, shard_layout
from disttrain.parallel.zero.stage1 import ZeRO1
from disttrain.parallel.zero.stage2 import ZeRO2
from disttrain.parallel.zero.stage3 import ZeRO3

STAGES: dict[int, Callable[..., ZeroWrapper]] = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
"""Stage number → wrapper class: ``STAGES[n](model, comm, optimizer_factory, config)``."""

__all__ = [
    "STAGES",
    "ModelStateBytes",
    "OptimizerFactory",
    "Piece",
    "ShardLayout",
    "ZeRO1",
    "ZeRO2",
    "ZeRO3",
    "ZeroConfig",
    "ZeroWrapper",
    "consolidate",
    "formula",
    "load",
    "measure",
    "measure_module",
    "read_plan",
    "save",
    "shard_layout",
    "zero_formula",
    "zero_measured",
]
