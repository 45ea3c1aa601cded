"""ZeRO (Rajbhandari et al. 2020): shard optimizer state (stage 1), gradients (stage 2) and
parameters (stage 3) over the ranks of a Communicator. See docs/zero.md.

    zero = ZeRO2(model, comm, lambda params: torch.optim.Adam(params), ZeroConfig())
    loss_fn(model(x), y).backward()    # gradients reduce-scattered bucket by bucket
    zero.step()                        # each rank updates its shard, then all-gathers
    zero.zero_grad()

The package, in reading order (one stage needs this file, :mod:`.sharding` and its own
module):

* :mod:`.sharding`: what every stage shares: :class:`ZeroConfig`, the :class:`ZeroWrapper`
  interface, the pure shard map of the flattened parameters (and how N shards map onto M),
  and the flat buffers whose views are the parameters;
* :mod:`.stage1`: optimizer state sharded; gradients all-reduced by reduce-scatter at step;
* :mod:`.stage2`: gradients sharded too, reduce-scattered bucket by bucket during backward
  (in one order on every rank: :mod:`disttrain.parallel.backward`, shared with DDP), with
  the staged reductions stage 3 reuses;
* :mod:`.stage3`: parameters sharded too, each unit (:mod:`.units`) gathered just before
  it runs;
* :mod:`.meta`: a model built on the meta device, initialised unit by unit into the shards
  (equal to eager initialisation, never whole on a rank);
* :mod:`.hybrid`: shard inside groups of S ranks, all-reduce across R replicas (HSDP), and
  the bytes each communicator sends per step;
* :mod:`.checkpoint`: sharded checkpoints that resume on any world size and any stage;
* :mod:`.memory`: model-state bytes per rank, measured and by the paper's formula (pure
  enough for the simulator to import), and what wrapping holds at once.
"""

from collections.abc import Callable

from disttrain.parallel.zero.checkpoint import consolidate, load, save
from disttrain.parallel.zero.hybrid import StepBytes, ring_step_bytes, step_bytes, zero_groups
from disttrain.parallel.zero.memory import (
    ModelStateBytes,
    WrapMemory,
    formula,
    measure,
    measure_module,
    zero_formula,
    zero_measured,
)
from disttrain.parallel.zero.meta import MetaInit
from disttrain.parallel.zero.sharding import (
    OptimizerFactory,
    Piece,
    ShardLayout,
    ZeroConfig,
    ZeroWrapper,
    read_plan,
    shard_layout,
)
from disttrain.parallel.zero.stage1 import ZeRO1
from disttrain.parallel.zero.stage2 import ZeRO2
from disttrain.parallel.zero.stage3 import ZeRO3

STAGES: dict[int, Callable[..., ZeroWrapper]] = {1: ZeRO1, 2: ZeRO2, 3: ZeRO3}
"""Stage number → wrapper class: ``STAGES[n](model, comm, optimizer_factory, config,
replicate=None, meta_init=None)``."""

__all__ = [
    "STAGES",
    "MetaInit",
    "ModelStateBytes",
    "OptimizerFactory",
    "Piece",
    "ShardLayout",
    "StepBytes",
    "WrapMemory",
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
    "ring_step_bytes",
    "save",
    "shard_layout",
    "step_bytes",
    "zero_formula",
    "zero_groups",
    "zero_measured",
]
