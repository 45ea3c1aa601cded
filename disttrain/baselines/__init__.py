"""PyTorch's and DeepSpeed's own implementations of disttrain's ideas, for comparison only.

Each is registered here beside the preset it implements (``baseline_of``), and runs through
the same training loop as disttrain's strategies, so a benchmark row compares like with
like: the same model, data, steps and measurements. disttrain's own code never imports this
package; ``disttrain run`` and ``disttrain bench`` find these names through
:data:`disttrain.train.strategies.STRATEGIES`, which loads it on first use::

    torch-ddp        torch.nn.parallel.DistributedDataParallel        (ddp)
    torch-zero1      ZeroRedundancyOptimizer under torch's DDP         (zero1, zero2)
    torch-fsdp       FSDP2 fully_shard per layer                       (zero3)
    torch-gpipe      torch.distributed.pipelining ScheduleGPipe        (gpipe)
    torch-tp[-sp]    torch.distributed.tensor.parallel plans           (tp, tp-sp)
    deepspeed-ddp    DeepSpeed's engine, ZeRO stage 0                  (ddp)
    deepspeed-zeroS  DeepSpeed ZeRO stage S                            (zero1..3)
    deepspeed-pipe   DeepSpeed's pipeline engine                       (1f1b)

Their traffic bypasses disttrain.comm (``counts_bytes = False``): the theoretical bytes are
shown instead.
"""

from __future__ import annotations

from disttrain.baselines.deepspeed_rows import (
    build_deepspeed,
    build_deepspeed_pipe,
    check_installed,
    check_pipe,
    unavailable,
)
from disttrain.baselines.torch_data_parallel import (
    build_torch_ddp,
    build_torch_fsdp,
    build_torch_zero1,
)
from disttrain.baselines.torch_pipeline import build_torch_gpipe
from disttrain.baselines.torch_tensor import build_torch_tp
from disttrain.train.strategies import TORCH_DP, StrategySpec, check_pipeline
from disttrain.train.strategies.mesh import check_mesh

_DS = {"check": check_installed, "loss_scaling": False, "workload": "collectives",
       "family": "deepspeed", "unavailable": unavailable}

BASELINES: dict[str, StrategySpec] = {
    "torch-ddp": StrategySpec(build_torch_ddp, "torch.nn.parallel.DistributedDataParallel "
                              "(baseline)", TORCH_DP, workload="collectives", family="torch",
                              baseline_of=("ddp",)),
    "torch-zero1": StrategySpec(build_torch_zero1, "torch ZeroRedundancyOptimizer under torch "
                                "DDP (baseline)", TORCH_DP, loss_scaling=False,
                                workload="collectives", family="torch",
                                baseline_of=("zero1", "zero2")),
    "torch-fsdp": StrategySpec(build_torch_fsdp, "torch FSDP2 fully_shard per layer: ZeRO "
                               "stage 3 (baseline)", loss_scaling=False,
                               workload="collectives", family="torch", baseline_of=("zero3",)),
    "deepspeed-ddp": StrategySpec(build_deepspeed(0), "DeepSpeed engine, ZeRO stage 0: data "
                                  "parallel (baseline, needs deepspeed)", baseline_of=("ddp",),
                                  **_DS),  # type: ignore[arg-type]
    **{f"deepspeed-zero{s}": StrategySpec(
        build_deepspeed(s), f"DeepSpeed ZeRO stage {s} (baseline, needs deepspeed)",
        baseline_of=(f"zero{s}",), **_DS) for s in (1, 2, 3)},  # type: ignore[arg-type]
    "torch-gpipe": StrategySpec(build_torch_gpipe, "torch.distributed.pipelining ScheduleGPipe "
                                "on the same split (baseline)",
                                frozenset({"schedule", "microbatches", "partition"}), "model",
                                check=check_pipeline, loss_scaling=False, family="torch",
                                baseline_of=("gpipe",)),
    "deepspeed-pipe": StrategySpec(build_deepspeed_pipe, "DeepSpeed's pipeline engine, one "
                                   "stage per rank (baseline, needs deepspeed)",
                                   frozenset({"microbatches"}), "model", check=check_pipe,
                                   loss_scaling=False, workload="p2p", family="deepspeed",
                                   baseline_of=("1f1b",), unavailable=unavailable),
    "torch-tp": StrategySpec(build_torch_tp, "torch.distributed.tensor.parallel (Colwise/"
                             "RowwiseParallel) on the same model (baseline)",
                             frozenset({"sequence_parallel"}), "mesh", check=check_mesh,
                             loss_scaling=False, workload="collectives", family="torch",
                             baseline_of=("tp",)),
    "torch-tp-sp": StrategySpec(build_torch_tp, "torch.distributed.tensor.parallel with "
                                "SequenceParallel (baseline)", frozenset({"sequence_parallel"}),
                                "mesh", check=check_mesh, loss_scaling=False,
                                workload="collectives", family="torch", baseline_of=("tp-sp",)),
}

__all__ = ["BASELINES"]
