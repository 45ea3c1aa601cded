"""A model for ``disttrain run --model tests.launch_scripts.silent:model`` whose rank
DISTTRAIN_TEST_VICTIM falls silent (SIGSTOP) at DISTTRAIN_TEST_PHASE:

    compute     in the forward pass of step 2, while the others compute too (they then
                wait for it in the gradient all-reduce)
    collective  inside its second all-reduce call, 0.5 s after entering it (the others are
                waiting in that all-reduce by then)
    killed      as ``collective``, but SIGKILL instead of SIGSTOP

Before it stops, the victim writes ``stopped-at`` (the time) in DISTTRAIN_TEST_DIR; every
rank writes ``pid-rank<R>`` there when its model is built. (The start-up phase is stopped
from outside, by the test, before the victim reaches the rendezvous.)
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.comm import Communicator
from disttrain.train.models import mlp


def _stop(directory: str, signum: int = signal.SIGSTOP) -> None:
    with open(os.path.join(directory, "stopped-at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signum)


class _Silent(nn.Module):
    def __init__(self, inner: nn.Module, stop_at_forward: int | None, directory: str) -> None:
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.stop_at_forward = stop_at_forward
        self.directory = directory

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.training and self.calls == self.stop_at_forward:
            _stop(self.directory)
        out: torch.Tensor = self.inner(x)
        return out


def _stop_in_collective(number: int, directory: str, signum: int) -> None:
    """Make this process's ``number``-th all-reduce call stop (or die) inside the call."""
    original = Communicator.all_reduce
    calls = [0]

    def all_reduce(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == number:
            time.sleep(0.5)
            _stop(directory, signum)
        return original(self, *args, **kwargs)

    Communicator.all_reduce = all_reduce  # type: ignore[method-assign]


def model(info: Any) -> nn.Module:
    rank = dist.get_rank() if dist.is_initialized() else 0
    directory = os.environ["DISTTRAIN_TEST_DIR"]
    with open(os.path.join(directory, f"pid-rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    victim = rank == int(os.environ["DISTTRAIN_TEST_VICTIM"])
    phase = os.environ["DISTTRAIN_TEST_PHASE"]
    if victim and phase in ("collective", "killed"):
        _stop_in_collective(2, directory,
                            signal.SIGKILL if phase == "killed" else signal.SIGSTOP)
    return _Silent(mlp(info), 2 if victim and phase == "compute" else None, directory)
