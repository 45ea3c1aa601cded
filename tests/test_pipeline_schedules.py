"""GPipe and 1F1B schedules as data, checked without processes: dependencies, no deadlock,
bubble (p − 1)/(m + p − 1), and the activations each stage holds."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from disttrain.parallel.pipeline import (
    SCHEDULES,
    Backward,
    Forward,
    RecvAct,
    RecvGrad,
    Schedule,
    ScheduleError,
    SendAct,
    SendGrad,
    format_schedule,
    get_schedule,
    gpipe,
    one_f_one_b,
    simulate,
)

SIZES = [(p, m) for p, m in itertools.product(range(1, 6), range(1, 11))]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_microbatch_once_in_dependency_order(name):
    for p, m in SIZES:
        result = simulate(get_schedule(name, p, m))  # raises on deadlock or a broken dependency
        when = {(x.stage, type(x.action), x.action.microbatch): x for x in result.slots}
        assert len(when) == 2 * p * m  # one F and one B per (stage, micro-batch)
        for s, mb in itertools.product(range(p), range(m)):
            forward, backward = when[s, Forward, mb], when[s, Backward, mb]
            assert backward.start >= forward.end
            if s > 0:
                assert forward.start >= when[s - 1, Forward, mb].end
            if s < p - 1:
                assert backward.start >= when[s + 1, Backward, mb].end


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("backward_time", [1.0, 2.0])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, backward_time):
    for p, m in SIZES:
        result = simulate(get_schedule(name, p, m), backward_time=backward_time)
        expected = (p - 1) / (m + p - 1)
        for s in range(p):
            assert result.idle_fraction(s) == pytest.approx(expected), (p, m, s)
        assert result.makespan == pytest.approx((m + p - 1) * (1 + backward_time))


def test_activations_held_gpipe_m_and_1f1b_p_minus_s():
    for p, m in SIZES:
        assert simulate(gpipe(p, m)).peak_in_flight == (m,) * p
        assert simulate(one_f_one_b(p, m)).peak_in_flight == tuple(
            min(p - s, m) for s in range(p))


def test_messages_match_the_stage_position():
    schedule = gpipe(3, 2)
    kinds = [{type(a) for a in schedule.actions(s)} for s in range(3)]
    assert RecvAct not in kinds[0] and SendGrad not in kinds[0]
    assert SendAct not in kinds[2] and RecvGrad not in kinds[2]
    assert {RecvAct, SendAct, RecvGrad, SendGrad} <= kinds[1]
    assert [str(a) for a in schedule.actions(1)[:3]] == ["rA0", "F0", "sA0"]


def test_1f1b_order():
    # PipeDream-Flush (Narayanan et al. 2021, fig. 4): stage s warms up with p − s − 1
    # forwards, alternates F and B, then drains. p = 4, stage 1: F0 F1 warm up; then
    # (F2 B0) (F3 B1) (F4 B2) (F5 B3); B4 B5 drain. With m = 2 < p − s − 1 = 3 on stage 0,
    # the warm-up is all m forwards.
    assert " ".join(map(str, one_f_one_b(4, 6).compute(1))) == (
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5")
    assert " ".join(map(str, one_f_one_b(4, 2).compute(0))) == "F0 F1 B0 B1"


def test_1f1b_is_warm_up_then_alternation_then_cool_down_in_micro_batch_order():
    """The definition, for every size: forwards and backwards each in micro-batch order
    (a cool-down run backwards fails here, also where two stages hide it from the
    numbers); min(p − s, m) forwards before the first backward; then strictly one backward
    after each further forward; the rest are backwards."""
    for p, m in SIZES:
        for s in range(p):
            order = one_f_one_b(p, m).compute(s)
            kinds = "".join("F" if isinstance(a, Forward) else "B" for a in order)
            assert [a.microbatch for a in order if isinstance(a, Forward)] == list(range(m))
            assert [a.microbatch for a in order if isinstance(a, Backward)] == list(range(m))
            first = min(p - s, m)
            assert kinds == "F" * first + "BF" * (m - first) + "B" * first, (p, m, s, kinds)


def test_gpipe_is_every_forward_then_every_backward_in_micro_batch_order():
    """Huang et al. 2019: each stage runs the m forwards, then the m backwards."""
    for p, m in SIZES:
        for s in range(p):
            assert [str(a) for a in gpipe(p, m).compute(s)] == (
                [f"F{i}" for i in range(m)] + [f"B{i}" for i in range(m)]), (p, m, s)


def test_grid_small_case_by_hand():
    assert format_schedule(gpipe(2, 2)).splitlines()[1:] == [
        "stage 0 | F0 F1  .  . B0 B1",
        "stage 1 |  . F0 F1 B0 B1  .",
    ]


def test_grid_p4_m8_rows():
    for schedule in (gpipe(4, 8), one_f_one_b(4, 8)):
        lines = format_schedule(schedule).splitlines()
        assert "bubble 0.273" in lines[0]
        for row in lines[1:]:
            cells = row.split("|")[1].split()
            assert len(cells) == 22 and cells.count(".") == 6


def _replace(schedule: Schedule, stage: int, actions: list) -> Schedule:
    stages = list(schedule.stages)
    stages[stage] = tuple(actions)
    return Schedule("broken", schedule.num_stages, schedule.num_microbatches, tuple(stages))


def test_deadlock_is_detected_and_named():
    # stage 0 waits for the gradient of micro-batch 0 before sending its activation
    broken = _replace(gpipe(2, 1), 0, [Forward(0), RecvGrad(0), SendAct(0), Backward(0)])
    with pytest.raises(ScheduleError, match=r"deadlocks: stage 0 waits at action #1 rG0; "
                                            r"stage 1 waits at action #0 rA0"):
        simulate(broken)


def test_micro_batches_in_different_orders_are_caught():
    good = gpipe(2, 2)
    swapped = [RecvAct(1), Forward(1), RecvAct(0), Forward(0), Backward(0), SendGrad(0),
               Backward(1), SendGrad(1)]
    with pytest.raises(ScheduleError, match="carries micro-batch 0"):
        simulate(_replace(good, 1, swapped))


@pytest.mark.parametrize(("stage", "actions", "message"), [
    (0, [Backward(0), Forward(0), SendAct(0)], "backward without a pending forward"),
    (1, [Forward(0), Backward(0), SendGrad(0)], "before its input activation"),
    (0, [SendAct(0), Forward(0), RecvGrad(0), Backward(0)], "not computed yet"),
    (0, [Forward(0), SendAct(0), SendAct(0), RecvGrad(0), Backward(0)],
     "stage 0 sent micro-batches \\[0\\] that stage 1 never received"),
])
def test_dependency_violations(stage, actions, message):
    with pytest.raises(ScheduleError, match=message):
        simulate(_replace(gpipe(2, 1), stage, actions))


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_arguments_are_checked(bad):
    with pytest.raises(ValueError, match="integer ≥ 1"):
        gpipe(bad, 4)
    with pytest.raises(ValueError, match="integer ≥ 1"):
        one_f_one_b(4, bad)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'"):
        get_schedule("zb", 2, 2)


def test_the_docs_page_shows_the_schedules_the_code_prints_now():
    """A check that docs/pipeline.md has not drifted from the code, not of the schedules
    (the tests above check those from their definitions)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text()
    assert format_schedule(gpipe(4, 8)) in doc
    assert format_schedule(one_f_one_b(4, 8)) in doc
    assert " ".join(map(str, one_f_one_b(4, 8).actions(1))) in doc
