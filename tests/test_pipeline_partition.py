"""Splitting a sequential model into stages: explicit, by parameters, by time; clear errors."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from torch import nn

from disttrain.parallel.pipeline import PartitionError, balance_by_cost, layers_of, param_costs
from disttrain.parallel.pipeline.partition import (
    check_balance,
    check_no_shared_parameters,
    choose_balance,
    stage_module,
    time_costs,
)


def _compositions(n: int, p: int):
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(p))


def _worst(costs, balance) -> float:
    worst, start = 0.0, 0
    for size in balance:
        worst = max(worst, sum(costs[start:start + size]))
        start += size
    return worst


def test_balance_by_cost_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        costs = [rng.choice([0, 1, 2, 5, 10, 40]) * rng.random() for _ in range(n)]
        balance = balance_by_cost(costs, p)
        assert len(balance) == p and sum(balance) == n and min(balance) >= 1
        best = min(_worst(costs, b) for b in _compositions(n, p))
        assert _worst(costs, balance) == pytest.approx(best), (costs, p, balance)


def test_balance_by_cost_examples():
    assert balance_by_cost([1, 1, 1, 1], 2) == (2, 2)
    assert balance_by_cost([10, 1, 1, 1, 1], 2) == (1, 4)
    assert balance_by_cost([5, 5, 5], 3) == (1, 1, 1)
    # among the splits with the least worst stage, the most even one
    assert balance_by_cost([4, 0, 0, 0, 4, 0], 2) == (3, 3)
    assert balance_by_cost([112, 0, 272, 0, 204, 0, 52], 4) == (1, 2, 2, 2)


def test_param_costs_and_balance_by_params():
    model = nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10), nn.ReLU(),
                          nn.Linear(10, 10))
    assert param_costs(list(model)) == [1100, 0, 1010, 0, 110]
    assert choose_balance(list(model), 2, "params") == (2, 3)


def test_stage_module_keeps_global_names():
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 4), nn.Linear(4, 1))
    part = stage_module(list(model), (1, 2, 1), 1)
    assert list(part.state_dict()) == ["2.weight", "2.bias"]
    full = model.state_dict()
    for name, tensor in part.state_dict().items():
        assert tensor is not None and torch.equal(tensor, full[name])
    x = torch.randn(5, 3)
    assert torch.equal(part(x), model[2](model[1](x)))


class _WithLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def layers(self) -> list[nn.Module]:
        return [self.a, nn.ReLU(), self.b]


def test_layers_of_accepts_sequential_modulelist_and_layers_method():
    assert len(layers_of(nn.Sequential(nn.ReLU(), nn.Tanh()))) == 2
    assert len(layers_of(nn.ModuleList([nn.ReLU()]))) == 1
    assert len(layers_of(_WithLayers())) == 3


def test_errors_say_what_to_fix():
    layers = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(PartitionError, match=r"cannot be split into pipeline.*`layers\(\)`"):
        layers_of(nn.Linear(2, 2))
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4 stages"):
        choose_balance(layers, 4, "params")
    with pytest.raises(PartitionError, match="integer ≥ 1"):
        choose_balance(layers, 0, "params")
    with pytest.raises(PartitionError, match="sums to 4 layers but the model has 3"):
        check_balance([2, 2], 3, 2)
    with pytest.raises(PartitionError, match="has 3 stages but the pipeline has 2"):
        choose_balance(layers, 2, [1, 1, 1])
    with pytest.raises(PartitionError, match="integer ≥ 1 layers"):
        check_balance([3, 0], 3)
    with pytest.raises(PartitionError, match="pass sample="):
        choose_balance(layers, 2, "time")
    with pytest.raises(PartitionError, match="unknown partition 'size'"):
        choose_balance(layers, 2, "size")
    with pytest.raises(PartitionError, match="non-negative"):
        balance_by_cost([1.0, float("nan")], 2)
    with pytest.raises(PartitionError, match="no layers"):
        layers_of(nn.Sequential())


def test_tied_weights_across_stages_are_refused():
    shared = nn.Linear(4, 4)
    layers = [shared, nn.ReLU(), nn.Linear(4, 4), shared]
    check_no_shared_parameters(layers, (4,))  # one stage: fine
    with pytest.raises(PartitionError, match="layer 3 on stage 1 shares a parameter"):
        check_no_shared_parameters(layers, (2, 2))


class _Slow(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x * 2


def test_time_costs_find_the_slow_layer_and_leave_training_state_alone():
    layers = [nn.Linear(4, 4), nn.Linear(4, 4), _Slow(), nn.Linear(4, 4), nn.Linear(4, 4)]
    layers[0].weight.grad = torch.ones(4, 4)
    torch.manual_seed(3)
    expected_random = torch.rand(3)
    torch.manual_seed(3)
    costs = time_costs(layers, torch.randn(8, 4).requires_grad_(False), repeats=2)
    torch.manual_seed(3)
    assert len(costs) == 5 and costs[2] == max(costs)
    assert torch.equal(layers[0].weight.grad, torch.ones(4, 4))
    assert layers[1].weight.grad is None
    assert torch.equal(torch.rand(3), expected_random)
    # the sleeping layer (≥ 20 ms) outweighs the four tiny linears together: a stage alone
    balance = choose_balance(layers, 3, "time", torch.randn(8, 4))
    assert (2, 3) in [(start, start + size) for start, size in
                      zip(itertools.accumulate((0, *balance)), balance)]
