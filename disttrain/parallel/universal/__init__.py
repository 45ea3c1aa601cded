"""The universal checkpoint: one layout every strategy writes its slices into and reads its
slices from, whatever the strategy and world size that wrote it (DeepSpeed's universal
checkpoint and torch.distributed.checkpoint's planner, without the conversion step).

Each tensor of the model's state is addressed by the model's own name (a parameter, a
buffer, an optimizer moment ``<param>/exp_avg`` or scalar ``<param>/step``) with its
global shape and dtype; each rank writes the rectangular blocks it holds, by global
offsets, and reads the overlap of the blocks written with the blocks it needs. Read in
this order:

* :mod:`.slices`: pure shard maps: blocks, tensor-parallel splits, the flat ranges ZeRO
  cuts, and where each block lies in a rank's memory;
* :mod:`.store`: the files (each rank's tensors and JSON), the merged index, the reader;
* :mod:`.state`: a rank's model and optimizer state as units and entries, saved and loaded.

ZeRO builds its units from its shard groups (:func:`disttrain.parallel.zero.checkpoint.
layout`); the training loop's strategies build theirs from their modules. See
docs/checkpoints.md.
"""

from disttrain.parallel.universal.slices import Box, Placement, Region, Split, regions
from disttrain.parallel.universal.state import (
    Entry,
    Layout,
    Unit,
    check_shapes,
    load,
    model_config,
    module_layout,
    persistent_buffers,
    save,
    tensor_parallel_splits,
)
from disttrain.parallel.universal.store import (
    DIRECTORY,
    FORMAT,
    Index,
    Reader,
    is_universal,
    read_index,
)

__all__ = [
    "DIRECTORY",
    "FORMAT",
    "Box",
    "Entry",
    "Index",
    "Layout",
    "Placement",
    "Reader",
    "Region",
    "Split",
    "Unit",
    "check_shapes",
    "is_universal",
    "load",
    "model_config",
    "module_layout",
    "persistent_buffers",
    "read_index",
    "regions",
    "save",
    "tensor_parallel_splits",
]
