"""What every ZeRO stage offers: the interface checkpoints, memory accounting and the
training loop rely on (each stage implements it in its own module)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel.zero.config import ZeroConfig
from disttrain.parallel.zero.flat import ShardGroup


class ZeroWrapper(Protocol):
    stage: int
    module: nn.Module  # the user's model (its parameters are views or placeholders)
    comm: Communicator
    config: ZeroConfig
    optimizer: torch.optim.Optimizer  # over this rank's flat master shards
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype

    @property
    def numel(self) -> int:
        """Ψ: trainable parameters in the model."""
        ...

    def step(self) -> None: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def no_sync(self) -> AbstractContextManager[None]: ...

    def shard_groups(self) -> list[ShardGroup]:
        """Each flat group's parameter names, shapes, layout and this rank's master shard."""
        ...

    def reload_from_masters(self) -> None:
        """Propagate overwritten master shards (a checkpoint load) into the parameters."""
        ...

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor the rank holds for the model's state: params, grads, optimizer."""
        ...
