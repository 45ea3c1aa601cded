"""A stage counts the bytes autograd saves once per forward signature: the reused count
equals a fresh count, and a new shape, mode or target is counted anew (no processes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.pipeline.stage import Stage


def make_stage() -> Stage:
    torch.manual_seed(0)
    return Stage(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), 1, 2)


def stashed_bytes(stage: Stage, x: torch.Tensor, target: torch.Tensor | None = None,
                  microbatch: int = 0) -> int:
    loss = None if target is None else (lambda out: F.cross_entropy(out, target))
    key = () if target is None else (tuple(target.shape), target.dtype,
                                     target.untyped_storage().nbytes())
    stage.forward(microbatch, x, source="stage 0", loss=loss, loss_key=key)
    return stage._stash[(microbatch, 0)].nbytes


def test_a_reused_count_equals_a_fresh_count():
    cached, fresh = make_stage(), make_stage()
    first = stashed_bytes(cached, torch.randn(4, 6), microbatch=0)
    again = stashed_bytes(cached, torch.randn(4, 6), microbatch=1)  # from the cache
    assert first == again == stashed_bytes(fresh, torch.randn(4, 6)) > 0
    assert len(cached._saved_bytes) == 1


def test_a_new_shape_mode_or_target_is_counted_anew():
    stage = make_stage()
    small = stashed_bytes(stage, torch.randn(4, 6), microbatch=0)
    large = stashed_bytes(stage, torch.randn(40, 6), microbatch=1)
    assert large > small
    target = torch.tensor([0, 1, 2, 0])
    with_loss = stashed_bytes(stage, torch.randn(4, 6), target, microbatch=2)
    assert with_loss != small
    stage.module.eval()
    stashed_bytes(stage, torch.randn(4, 6), microbatch=3)
    assert len(stage._saved_bytes) == 4
    for mb in range(3):
        stage.backward(mb, None if mb == 2 else [torch.ones_like(stage.output_leaves(mb)[0])])
