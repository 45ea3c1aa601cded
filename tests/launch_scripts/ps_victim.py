"""A test-only model for ``disttrain run --model tests.launch_scripts.ps_victim:mlp``: the
registry's MLP, but the rank named by ``PS_KILL=RANK:STEP`` SIGKILLs itself at the start
of its training forward number STEP (1-based), mid-run, whatever launched it."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.train.data import DataInfo
from disttrain.train.models import mlp as registry_mlp


class KillsItself(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        victim, step = os.environ.get("PS_KILL", "-1:0").split(":")
        self.victim, self.step, self.calls = int(victim), int(step), 0

    def forward(self, x: Any) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.step and dist.get_rank() == self.victim:
                os.kill(os.getpid(), signal.SIGKILL)
        out: torch.Tensor = self.inner(x)
        return out


def mlp(info: DataInfo) -> nn.Module:
    return KillsItself(registry_mlp(info))
