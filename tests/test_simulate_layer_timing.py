"""Layer timing happens where training runs the layers: inside whole-model passes."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from disttrain.probe.layer_timing import pass_times, run_layers

SLOW_FORWARD, SLOW_BACKWARD = 0.004, 0.008


class _SlowIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLOW_FORWARD)
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLOW_BACKWARD)
        return grad


class Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowIdentity.apply(x)


@pytest.mark.parametrize("where", [0, 1, 3])
def test_each_layers_time_lands_on_that_layer_forward_and_backward(where: int) -> None:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2)]
    layers.insert(where, Slow())
    rows = run_layers(layers, torch.randn(4, 8))
    for i, (fwd, bwd, _, out_bytes) in enumerate(rows):
        if i == where:
            assert fwd >= SLOW_FORWARD and bwd >= SLOW_BACKWARD, (i, fwd, bwd)
        else:  # an attribution one layer off would move the sleep here
            assert fwd < SLOW_FORWARD / 2 and bwd < SLOW_BACKWARD / 2, (i, fwd, bwd)
        assert out_bytes == 4 * (2 if i == len(rows) - 1 else 8) * 4
    for layer in layers:  # the passes left no gradient behind
        assert all(p.grad is None for p in layer.parameters())


def test_layers_whose_output_takes_no_gradient_keep_standalone_times() -> None:
    frozen = nn.Linear(8, 8).requires_grad_(False)
    layers: list[nn.Module] = [frozen, nn.Linear(8, 2)]
    assert pass_times(layers, torch.randn(4, 8)) is None
    rows = run_layers(layers, torch.randn(4, 8))
    assert len(rows) == 2 and all(f > 0 for f, _, _, _ in rows)


def test_an_in_place_layer_counts_its_backward_in_the_layer_before() -> None:
    layers: list[nn.Module] = [nn.Linear(8, 8), Slow(), nn.ReLU(inplace=True), nn.Linear(8, 2)]
    times = pass_times(layers, torch.randn(4, 8))
    assert times is not None
    assert all(f >= 0 and b >= 0 for f, b in times)
    assert times[2][1] < SLOW_BACKWARD / 2  # the in-place ReLU shares Slow's output tensor
    assert times[1][1] >= SLOW_BACKWARD  # Slow's own backward is still found
