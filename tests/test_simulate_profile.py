"""The compute profile: rounds of layer timings at different moments, the median kept, and
each overhead the median of its measurements."""

from __future__ import annotations

import pytest
import torch
from torch import nn


def test_the_profile_keeps_the_median_round_of_each_batch_size() -> None:
    """Rounds at different moments disagree (this machine drifts); the layer times come
    from the round whose layers sum to the median, per batch size, not the fastest."""
    from disttrain.probe.profiler import LayerRounds

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    rounds = LayerRounds(model, (torch.randn(4, 8), torch.randn(32, 8)))

    def rows(scale: float, batch: int) -> list[tuple[float, float, int, int]]:
        return [(scale * (1e-3 + batch * 1e-4), scale * batch * 2e-4, 8, 8 * batch),
                (scale * batch * 1e-5, scale * batch * 1e-5, 0, 4 * batch)]

    for small, large in ((3.0, 2.0), (1.0, 3.0), (2.0, 1.0)):  # in each, the median is 2
        rounds.small.append(rows(small, 4))
        rounds.large.append(rows(large, 32))
    first, second = rounds.layer_profiles()
    assert first.forward_fixed == pytest.approx(2e-3)
    assert first.forward_per_sample == pytest.approx(2e-4)
    assert first.backward(32) == pytest.approx(2.0 * 32 * 2e-4)
    assert second.backward(32) == pytest.approx(2.0 * 32 * 1e-5)
    assert first.output_bytes_per_sample == 8 and first.params == 72 and first.tensors == 2
    rounds.small.append(rows(0.5, 4))  # an even count: the lower of the middle two
    assert rounds.median() == (rows(1.0, 4), rows(2.0, 32))
    assert rounds.totals(1) == pytest.approx([s * 32 * 3.2e-4 + s * 1e-3 for s in (2, 3, 1)])


def test_a_later_round_leaves_the_model_and_the_thread_count_as_they_were() -> None:
    from disttrain.probe.profiler import LayerRounds

    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    threads = torch.get_num_threads()
    rounds = LayerRounds(model, (torch.randn(4, 8), torch.randn(16, 8)),
                         threads=max(1, threads - 1) if threads > 1 else 2)
    with pytest.raises(ValueError, match="no rounds taken"):
        rounds.median()
    rounds.sample()
    rounds.sample()
    assert len(rounds.small) == len(rounds.large) == 2 and all(t > 0 for t in rounds.totals())
    assert torch.get_num_threads() == threads
    for key, value in model.state_dict().items():  # the running statistics too
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_the_profile_keeps_each_overheads_median_over_its_measurements() -> None:
    from disttrain.probe.profiler import LayerRounds
    from disttrain.simulate.overheads import Overheads
    from disttrain.simulate.profile import ModelProfile

    measured = [Overheads(step_s=1e-3, stage_wakeup_s=5e-4, wakeup_by_ranks={4: 3e-3}),
                Overheads(step_s=4e-3, stage_wakeup_s=1e-4, zero_s={1: 1e-3}),
                Overheads(step_s=2e-3, stage_wakeup_s=9e-4, wakeup_by_ranks={4: 1e-3},
                          concurrent_slowdown=1.5)]
    mid = Overheads.median(measured)
    assert (mid.step_s, mid.stage_wakeup_s, mid.concurrent_slowdown) == (2e-3, 5e-4, 1.0)
    assert mid.wakeup_by_ranks == {4: 2e-3} and mid.zero_s == {1: 1e-3}  # over those with it
    with pytest.raises(ValueError, match="at least one"):
        Overheads.median([])

    model = nn.Sequential(nn.Linear(8, 8))
    later = iter(measured[1:])
    rounds = LayerRounds(model, (torch.randn(4, 8), torch.randn(16, 8)),
                         overheads=lambda: next(later))
    rounds.sample()
    base = ModelProfile("toy", rounds.layer_profiles(), 1.0, 0.0, overheads=measured[0])
    assert rounds.profile(base).overheads == base.overheads  # nothing measured again yet
    rounds.sample_overheads()
    rounds.sample_overheads()
    assert rounds.profile(base).overheads == mid
    with pytest.raises(ValueError, match="without a way to measure overheads"):
        LayerRounds(model, rounds.inputs).sample_overheads()
