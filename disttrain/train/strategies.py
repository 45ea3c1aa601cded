"""Strategies: how one training step runs on a communicator. A registry of name → spec.

The loop is the same for every strategy; a :class:`Strategy` owns what differs: the wrapped
model that forward calls, the optimizer, the data-parallel coordinates that decide which
shard of the data this rank reads, and the step itself. Adding a strategy is one entry in
:data:`STRATEGIES` (later: parameter server, pipeline, ZeRO)::

    "single"     one process, the reference every other strategy must match
    "ddp"        disttrain.parallel.DataParallel: bucketed all-reduce over disttrain.comm
    "torch-ddp"  torch.nn.parallel.DistributedDataParallel on the same Gloo group (baseline)
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.train.config import TrainConfig

Batch = tuple[Any, Any]  # (inputs, targets)
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def optimizer_factory(config: TrainConfig) -> OptimizerFactory:
    """Build the configured optimizer over some parameters (a strategy decides which)."""

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        if config.optimizer == "sgd":
            return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                                   weight_decay=config.weight_decay)
        if config.optimizer == "adam":
            return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)

    return make


class Strategy:
    """Plain training on this rank; data-parallel strategies swap in a wrapped ``model``.

    ``module`` is the bare model (evaluation, checkpoints); ``model`` is what forward calls.
    """

    counts_bytes = True  # comm.stats sees this strategy's traffic
    sharded_state = False  # True: every rank saves its own state_dict in a checkpoint

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Communicator | None, model: nn.Module | None = None) -> None:
        self.module = module
        self.model: nn.Module = model if model is not None else module
        self.optimizer = optimizer
        self.comm = comm

    @property
    def dp_rank(self) -> int:
        """This rank's index among the ranks that read different data."""
        return self.comm.rank if self.comm is not None else 0

    @property
    def dp_size(self) -> int:
        """How many ranks read different shards of each global batch."""
        return self.comm.world_size if self.comm is not None else 1

    def no_sync(self) -> AbstractContextManager[Any]:
        """Skip gradient synchronization (all micro-batches but the last of a step)."""
        return nullcontext()

    def train_step(self, micro_batches: Sequence[Batch], loss_fn: LossFn,
                   autocast: Callable[[], AbstractContextManager[Any]]) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches; returns the mean loss (detached).

        Each micro-batch loss is divided by their count, so accumulated gradients equal the
        gradient of the mean loss over this rank's share of the global batch.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float32)
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            with self.no_sync() if i < last else nullcontext():
                with autocast():
                    loss = loss_fn(self.model(inputs), targets) / len(micro_batches)
                loss.backward()
            total += loss.detach().float()
        self.optimizer.step()
        return total

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        """Release wrappers and communication state (called once, at the end of training)."""


class DataParallelStrategy(Strategy):
    """A DDP-style wrapper: gradients averaged over ranks during backward, ``no_sync`` for
    accumulation."""

    def no_sync(self) -> AbstractContextManager[Any]:
        return self.model.no_sync()  # type: ignore[operator, no-any-return]


class TorchDDPStrategy(DataParallelStrategy):
    """torch's DistributedDataParallel: its traffic bypasses disttrain.comm's counters."""

    counts_bytes = False

    def close(self) -> None:
        # Dropping the DDP reducer before destroy_process_group avoids Gloo's abort at exit
        # ("terminate called without an active exception", 7 of 30 runs in research/baseline).
        self.model = self.module
        gc.collect()


Builder = Callable[[nn.Module, "Communicator | None", OptimizerFactory, TrainConfig], Strategy]


@dataclass(frozen=True)
class StrategySpec:
    """A registry entry: how to build the strategy and which world sizes it accepts."""

    build: Builder
    description: str
    max_world_size: int | None = None
    needs_comm: bool = True

    def data_parallel_size(self, world_size: int) -> int:
        return world_size

    def check_world(self, world_size: int, name: str) -> None:
        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ValueError(f"strategy {name!r} runs on at most {self.max_world_size} "
                             f"process(es), not {world_size}; use -n {self.max_world_size} "
                             f"or a parallel strategy such as 'ddp'")


def _single(module: nn.Module, comm: Communicator | None, make_optimizer: OptimizerFactory,
            config: TrainConfig) -> Strategy:
    if config.parallel.compression is not None or config.parallel.algorithm is not None:
        raise ValueError("strategy 'single' has no gradient traffic: compression and algorithm "
                         "apply to 'ddp'")
    return Strategy(module, make_optimizer(module.parameters()), comm)


def _require(comm: Communicator | None, name: str) -> Communicator:
    if comm is None:
        raise ValueError(f"strategy {name!r} needs a communicator (run it under "
                         f"'disttrain run -n N' or pass comm=...)")
    return comm


def _ddp(module: nn.Module, comm: Communicator | None, make_optimizer: OptimizerFactory,
         config: TrainConfig) -> Strategy:
    comm = _require(comm, "ddp")
    try:
        from disttrain.parallel import DataParallel
    except ImportError as exc:
        raise RuntimeError(f"strategy 'ddp' needs disttrain.parallel.DataParallel, which "
                           f"cannot be imported here ({exc})") from exc
    opts = config.parallel
    model = DataParallel(module, comm, bucket_cap_mb=opts.bucket_cap_mb,
                         find_unused_parameters=opts.find_unused_parameters,
                         broadcast_buffers=opts.broadcast_buffers, compression=opts.compression,
                         algorithm=opts.algorithm)
    return DataParallelStrategy(module, make_optimizer(module.parameters()), comm, model)


def _torch_ddp(module: nn.Module, comm: Communicator | None, make_optimizer: OptimizerFactory,
               config: TrainConfig) -> Strategy:
    comm = _require(comm, "torch-ddp")
    group = comm.transport.native_group
    if group is None:
        raise ValueError("strategy 'torch-ddp' needs a torch.distributed process group; "
                         "use the 'torch' transport")
    if config.parallel.compression is not None or config.parallel.algorithm is not None:
        raise ValueError("strategy 'torch-ddp' uses torch's own all-reduce: compression and "
                         "algorithm apply to 'ddp'")
    opts = config.parallel
    # torch ≥ 2.13 warns that broadcast_buffers is deprecated; True is its default anyway
    extra: dict[str, Any] = {} if opts.broadcast_buffers else {"broadcast_buffers": False}
    model = nn.parallel.DistributedDataParallel(
        module, process_group=group, bucket_cap_mb=opts.bucket_cap_mb,
        find_unused_parameters=opts.find_unused_parameters, **extra)
    return TorchDDPStrategy(module, make_optimizer(module.parameters()), comm, model)


STRATEGIES: dict[str, StrategySpec] = {
    "single": StrategySpec(_single, "one process, the reference", max_world_size=1,
                           needs_comm=False),
    "ddp": StrategySpec(_ddp, "disttrain DataParallel: bucketed all-reduce overlapping backward"),
    "torch-ddp": StrategySpec(_torch_ddp, "torch.nn.parallel.DistributedDataParallel (baseline)"),
}


def get_strategy(name: str) -> StrategySpec:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; choose one of: "
                         f"{', '.join(STRATEGIES)}") from None
