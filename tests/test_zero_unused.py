"""A module with parameters that forward never calls: every ZeRO stage updates it with a zero
gradient (docs/zero.md) and matches one process doing exactly that.

Stage 3 is the interesting one: such a unit is never gathered, so its parameters are still
the empty placeholders when the end of backward reduces it (issue 35, item 8).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import zero
from tests import zero_cases
from tests.zero_cases import OPTIMIZERS, full_params, local_batch, loss_fn

STEPS = 3


class PartlyUsed(nn.Module):
    """``unused`` sits between the two layers forward calls (model order and unit order)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(zero_cases.IN, 4)
        self.unused = nn.Linear(4, 2)
        self.used = nn.Linear(4, zero_cases.OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(torch.tanh(self.first(x)))


def make_partly_used() -> PartlyUsed:
    torch.manual_seed(0)
    return PartlyUsed()


def reference(steps: int) -> dict[str, torch.Tensor]:
    """One process on the global batch; parameters without a gradient get zeros (AdamW's
    weight decay still moves them), as a flat-parameter optimizer does."""
    model = make_partly_used()
    opt = OPTIMIZERS["adamw"](model.parameters())
    for step in range(steps):
        x, y = zero_cases.batch(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run_partly_used(comm: Communicator, stage: int, units: str) -> dict[str, torch.Tensor]:
    model = make_partly_used()
    kwargs: dict[str, Any] = {}
    if units == "explicit":
        kwargs["units"] = [model.first, model.unused, model.used]
    z = zero.STAGES[stage](model, comm, OPTIMIZERS["adamw"], **kwargs)
    forward = z if stage == 3 else z.module
    for step in range(STEPS):
        x, y = local_batch(step, comm.rank, comm.world_size)
        z.zero_grad()
        loss_fn(forward(x), y).backward()
        z.step()
    return full_params(z)


@pytest.mark.parametrize(("stage", "units"), [(1, "default"), (2, "default"),
                                              (3, "default"), (3, "explicit")])
def test_module_never_called_gets_a_zero_gradient(pools, stage, units):
    expected = reference(STEPS)
    before = make_partly_used().unused.weight.detach()
    assert not torch.allclose(expected["unused.weight"], before)  # weight decay moved it
    for rank, params in enumerate(pools(2).run(run_partly_used, stage, units)):
        assert params.keys() == expected.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name],
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")
