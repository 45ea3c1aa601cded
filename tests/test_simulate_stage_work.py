"""A pipeline stage's own work per message (``Overheads.stage_work_s``): probed on the real
runtime in two forked stages, and charged on the stages' compute in the simulation with
the link keeping the rest of the message's price (fixed numbers in, exact timelines out)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from disttrain.comm.cost_model import LinkCosts
from disttrain.simulate.overheads import Overheads
from disttrain.simulate.pipeline import simulate_pipeline
from tests.test_simulate_overheads import _case

ALPHA = 0.25
COSTS = LinkCosts(alpha=ALPHA, beta=0.0, gamma=0.0, native_alpha=ALPHA, native_beta=0.0)


def _extra(workers: int, overheads: Overheads, name: str = "model-parallel", m: int = 1,
           cores: int = 2) -> float:
    """The step on this 2-core "machine" with ``overheads`` and α = 0.25 s, less the step
    with free messages and no overheads (toy layers: 1 s forward, 2 s backward a sample)."""
    run = simulate_pipeline(_case(workers, overheads, cores=cores, costs=COSTS,
                                  pp_size=workers, microbatches=m), name)
    free = simulate_pipeline(_case(workers, Overheads(), cores=cores, pp_size=workers,
                                   microbatches=m), name)
    return run.step_s - free.step_s


def test_one_message_at_a_time_pays_its_probed_price_however_the_stages_share_it() -> None:
    """Model parallelism on 2 stages sends an activation and a gradient one after the other,
    each into a stage that sat idle (woken in full). A message's price is the probe (1 s):
    with 0.3 s of it on each stage's own thread, the link keeps 0.4 s and the step is the
    same; where the runtime's probe says the stages need 0.7 s each, more than the whole
    message the probe timed, each pays half the probe and the message still costs 1 s
    (charging more read model parallelism on 4 ranks at 1.16-1.30 of its runs)."""
    probed = Overheads(stage_message_s=1.0, stage_wakeup_s=0.5, collective_wakeup_after_s=1.0)
    assert _extra(2, probed) == pytest.approx(2 * (1.0 + 0.5))
    assert _extra(2, replace(probed, stage_work_s=0.3)) == pytest.approx(2 * (1.0 + 0.5))
    assert _extra(2, replace(probed, stage_work_s=0.7)) == pytest.approx(2 * (1.0 + 0.5))
    assert dict(replace(probed, stage_work_s=0.7).named())["stage_work_s"] == 0.7


def test_with_micro_batches_in_flight_the_stages_own_work_is_not_hidden_by_the_link() -> None:
    """GPipe, m = 2, on 2 stages (2 s forward, 4 s backward per micro-batch): two of the
    four messages are on the critical path, the first activation and the last gradient,
    each at α (the probe, 0.1 s, is below it). When 0.05 s of each message is its sender's
    and its receiver's own work, that work is charged to the stages: stage 0 posts its
    first activation before its second forward, whose activation reaches stage 1 0.05 s
    later, and stage 1 its first gradient before its second backward, so the step grows by
    2α + 2 · 0.05 (not 2α: the link does not overlap it)."""
    below = Overheads(stage_message_s=0.1)
    assert _extra(2, below, "gpipe", 2) == pytest.approx(2 * ALPHA)
    assert _extra(2, replace(below, stage_work_s=0.05), "gpipe", 2) == pytest.approx(
        2 * ALPHA + 2 * 0.05)
    # and in full beyond half the probe: model parallelism's cap is not applied here
    assert _extra(2, replace(below, stage_work_s=0.3), "gpipe", 2) > \
        _extra(2, replace(below, stage_work_s=0.05), "gpipe", 2) + 2 * (0.3 - 0.05)
    # on a cluster (a device per rank) the host's probes say nothing: α alone
    assert _extra(2, replace(below, stage_work_s=0.05), "gpipe", 2, cores=0) == \
        pytest.approx(2 * ALPHA)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_the_stage_work_probe_reads_work_added_to_each_send(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage sends one message and receives one per micro-batch, in GPipe and in
    1F1B alike. Work added to every send (a sleep: not a wait for the other stage) is the
    stages' own, so the probe reads more per message in both schedules (an ordering: how
    much is measured by the benchmark, not asserted here); and what it reads is each
    stage's own time per step (median), summed over the stages and divided by the
    messages they handle, checked on the very steps it measured."""
    import statistics

    import disttrain.probe.stage_probe as stage_probe
    from disttrain.parallel.pipeline.link import StageLink

    measured: list[list[Any]] = []
    forked = stage_probe.forked_ranks

    def keep(*args: Any, **kwargs: Any) -> list[Any]:
        per_rank = forked(*args, **kwargs)
        measured.append(per_rank)
        return per_rank

    monkeypatch.setattr(stage_probe, "forked_ranks", keep)
    net, x = _net(), torch.randn(4, 8)
    plain = stage_probe.stage_work(net, x)
    assert sorted(plain) == ["1f1b", "gpipe"] and all(v > 0 for v in plain.values())
    send = StageLink.send

    def slow_send(self: StageLink, *args: object, **kwargs: object) -> object:
        time.sleep(0.004)
        return send(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(StageLink, "send", slow_send)  # the forked stages inherit it
    slowed = stage_probe.stage_work(net, x)
    for name in ("gpipe", "1f1b"):
        assert slowed[name] > plain[name], name
    m = stage_probe.MICROBATCHES
    for result, per_rank in zip((plain, slowed), measured, strict=True):
        assert sorted(rank for rank, _ in per_rank) == [0, 1]
        for name in ("gpipe", "1f1b"):
            own = sum(statistics.median(steps[name]) for _, steps in per_rank)
            assert result[name] == pytest.approx(own / (2 * 2 * m)), name  # 2m each end


def test_a_middle_stage_handles_twice_the_messages_of_an_end() -> None:
    """The probe divides the stages' own work by the messages they handle: 2·m at either
    end of the pipeline (one direction each way), 4·m in the middle."""
    from disttrain.probe.stage_probe import MICROBATCHES, _message_ends

    m = MICROBATCHES
    assert [_message_ends(r, 2) for r in range(2)] == [2 * m, 2 * m]
    assert [_message_ends(r, 4) for r in range(4)] == [2 * m, 4 * m, 4 * m, 2 * m]


def test_1f1b_stages_pay_their_crossing_messages_and_gpipes_do_not() -> None:
    """1F1B's stages pay ``crossing`` per message on top of their own work, probed with
    the most stages not above the step's (here the 4-stage probe on 4 workers, the 2-stage
    one on 3), and so does nothing else: GPipe's step is the same with or without it, and
    on a cluster (a device per rank) neither is charged."""
    base = Overheads(stage_message_s=0.1, stage_work_s=0.05)
    crossing = replace(base, crossing_by_ranks={2: 0.01, 4: 0.2})
    assert crossing.crossing(3) == 0.01 and crossing.crossing(4) == 0.2
    assert crossing.crossing(8) == 0.2 and Overheads().crossing(4) == 0.0
    assert dict(crossing.named())["stage_crossing_4ranks_s"] == 0.2
    assert Overheads.median([crossing, replace(crossing, crossing_by_ranks={4: 0.4})]
                            ).crossing_by_ranks == {2: 0.01, 4: pytest.approx(0.3)}
    for workers in (2, 4):  # as many micro-batches as workers: one sample each
        assert _extra(workers, crossing, "gpipe", workers) == pytest.approx(
            _extra(workers, base, "gpipe", workers))
        assert _extra(workers, crossing, "1f1b", workers, cores=0) == pytest.approx(
            _extra(workers, base, "1f1b", workers, cores=0))
    # on 4 stages the excess is 0.2 s a message and a middle stage handles 16 of them:
    # 3.2 s of work on each of two stages, 1.6 s each on the ends, sharing 2 cores
    assert _extra(4, crossing, "1f1b", 4) > _extra(4, base, "1f1b", 4) + 3.0


def test_a_pipeline_pays_the_stage_work_probed_on_its_own_stage_count() -> None:
    """``stage_work_by_ranks`` holds the probe on more stages than 2: a 4-stage pipeline
    pays it, a 2- or 3-stage one the 2-stage ``stage_work_s``."""
    two = Overheads(stage_message_s=0.1, stage_work_s=0.05)
    four = replace(two, stage_work_by_ranks={4: 0.1})
    assert four.stage_work(2) == four.stage_work(3) == 0.05 and four.stage_work(4) == 0.1
    assert dict(four.named())["stage_work_4ranks_s"] == 0.1
    for name in ("gpipe", "1f1b"):
        assert _extra(2, four, name, 2) == pytest.approx(_extra(2, two, name, 2))
        assert _extra(4, four, name, 4) == pytest.approx(
            _extra(4, replace(two, stage_work_s=0.1), name, 4))


def test_a_model_without_two_stages_is_reported_and_charges_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    from disttrain.probe.stage_probe import stage_work

    with caplog.at_level(logging.WARNING):
        assert stage_work(nn.Linear(8, 4), torch.randn(4, 8)) == {}
    assert "could not measure a pipeline stage's own work" in caplog.text


@pytest.mark.parametrize(("name", "m", "extra"), [("model-parallel", 1, 0.5), ("gpipe", 4, 1.0),
                                              ("1f1b", 4, 1.0)])
def test_only_the_first_stages_loop_precedes_the_step_the_others_overlap_its_tail(
        name: str, m: int, extra: float) -> None:
    """4 stages on 2 cores with 0.5 s of training-loop work per step on every stage: in a
    run of steps the first stage's loop precedes its first forward, the others' follow
    their optimizer while the stages before them still go backward. Model parallelism
    computes on one stage at a time, so the step grows by the loop once, at full speed
    (until the night of 2026-11-26 the four loops shared the 2 cores at the step's start:
    1 s). With 4 micro-batches the backward keeps the cores busy, and the four loops' 2 s
    of work spread over the 2 cores: 1 s either way."""
    def step(overheads: Overheads) -> float:
        case = _case(4, overheads, cores=2, pp_size=4, microbatches=m)
        return simulate_pipeline(case, name).step_s

    assert step(Overheads(step_s=0.5)) - step(Overheads()) == pytest.approx(extra)
