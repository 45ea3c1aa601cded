"""Memory a strategy holds, measured from its tensors: the activation tracker against hand
counts, unique-storage counting, and every data-parallel strategy's model-state bytes
against the ZeRO paper's formula on 2 ranks (ZeRO-3 holds DDP's bytes / N)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from disttrain.train import TrainConfig, train
from disttrain.train.memory import (
    ActivationTracker,
    formula_bytes,
    measure_state,
    state_bytes_per_param,
)


def test_tracker_counts_saved_activations_and_releases_them():
    """y = relu(x @ w1) @ w2: autograd saves x (for w1's gradient), relu's output and the
    hidden it feeds to w2 (one storage), never the weights themselves."""
    torch.manual_seed(0)
    w1 = nn.Parameter(torch.randn(16, 32))
    w2 = nn.Parameter(torch.randn(32, 4))
    x = torch.randn(8, 16)
    tracker = ActivationTracker()
    with tracker:
        y = torch.relu(x @ w1) @ w2
        assert tracker._current == 8 * 16 * 4 + 8 * 32 * 4  # x, and relu's output once
        y.sum().backward()
    assert tracker.peak == 8 * 16 * 4 + 8 * 32 * 4
    assert tracker._current == 0  # backward released every saved tensor


def test_tracker_keeps_the_peak_over_steps_and_ignores_parameters_only_graphs():
    w = nn.Parameter(torch.randn(64))
    tracker = ActivationTracker()
    with tracker:
        (w * w).sum().backward()  # saves w twice: a parameter, not an activation
    assert tracker.peak == 0
    with tracker:
        big = torch.randn(1000, requires_grad=True) * 2.0  # a non-leaf: an activation
        (big.exp()).sum().backward()
    with tracker:
        small = torch.randn(10, requires_grad=True) * 2.0
        (small.exp()).sum().backward()
    assert tracker.peak == 1000 * 4  # exp saves its output: the larger step's


def test_views_of_one_storage_count_once():
    flat = torch.zeros(100)
    views = [flat[:40], flat[40:]]
    other = torch.zeros(10)
    state = measure_state({"params": views, "grads": [flat, other], "optimizer": []})
    assert state.params == 400 and state.grads == 40 and state.total == 440


def test_only_the_bytes_the_tensors_span_count():
    """A buffer mapping every rank's region (shared memory) holds this rank's gradients in
    its own region: the others' are not this rank's model state."""
    segment = torch.zeros(4 * 256)  # 4 ranks' regions of 256 floats
    mine = segment[512:768]
    grads = [mine[:100].view(10, 10), mine[100:200], mine[150:256]]  # overlapping views
    state = measure_state({"params": [], "grads": grads, "optimizer": [mine[:10]]})
    assert state.grads == 256 * 4 and state.optimizer == 0  # the storage is the grads'
    strided = torch.zeros(10, 10)[:, 0]  # a column spans 91 elements of its storage
    assert measure_state({"params": [strided]}).params == 91 * 4
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)  # ZeRO-3's gathered buffers between uses
    assert measure_state({"params": [freed]}).params == 0


@pytest.mark.parametrize("name,expected", [
    ("ddp", 16 * 1000), ("zero1", 8 * 1000 + 8 * 1000 // 4),
    ("zero2", 4 * 1000 + 12 * 1000 // 4), ("zero3", 16 * 1000 // 4)])
def test_formula_is_the_papers_for_adam(name, expected):
    k = state_bytes_per_param("adam", 0.0)
    state = formula_bytes(name, 1000, 4, k)
    assert state is not None and state.total == expected


def rank_memory(comm, config: TrainConfig):
    return train(config, comm).without_model()


def test_zero_stages_shrink_model_state_by_the_formula(pools):
    """Adam on an MLP (Ψ = 26,122, even: no shard padding on 2 ranks): each strategy's
    measured model-state bytes equal the formula, and ZeRO-3 holds DDP's bytes / N."""
    config = TrainConfig(model="mlp", optimizer="adam", lr=1e-3, steps=2, global_batch=32,
                         log_every=0, progress=False, eval_every=0)
    measured = {}
    for strategy in ("ddp", "zero1", "zero2", "zero3"):
        results = pools(2).run(rank_memory, dataclasses.replace(config, strategy=strategy))
        for result in results:
            state, formula = result.model_state_bytes, result.model_state_formula_bytes
            # Adam's step counters (one scalar per tensor) are the only bytes beyond it
            assert state["total"] == pytest.approx(formula["total"], rel=0.01), strategy
            assert result.activation_peak_bytes > 0
        measured[strategy] = max(r.model_state_bytes["total"] for r in results)
    psi = 26122
    assert measured["ddp"] == pytest.approx(16 * psi, rel=0.01)
    assert measured["zero3"] == pytest.approx(measured["ddp"] / 2, rel=0.05)
    assert measured["ddp"] > measured["zero1"] > measured["zero2"] > measured["zero3"]
