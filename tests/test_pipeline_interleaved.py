"""Interleaved 1F1B as data, checked without processes: dependency order, no deadlock,
every (micro-batch, chunk) once, and the bubble (p − 1)/(v·m + p − 1), for Megatron-LM's
compute order and for the runtime's action lists with their messages round the ring."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.parallel.pipeline import ScheduleError, format_schedule, get_schedule, simulate
from disttrain.parallel.pipeline.schedules import (
    ChunkAction,
    InterleavedScheduleError,
    RecvAct,
    interleaved,
    interleaved_1f1b,
    simulate_interleaved,
)


def megatron_order(rank: int, p: int, v: int, m: int) -> list[str]:
    """Megatron-LM's order, written out from ``forward_backward_pipelining_with_interleaving``
    (megatron/core/pipeline_parallel/schedules.py): ``num_warmup_microbatches`` =
    (p − rank − 1)·2 + (v − 1)·p, at most all m·v (all of them when m = p); then one
    forward and one backward; then the remaining backwards. The k-th forward runs
    ``get_model_chunk_id(k, forward=True)`` = (k mod p·v) // p on micro-batch
    ``get_microbatch_id_in_model_chunk(k)`` = (k // p·v)·p + k mod p; the k-th backward
    the same micro-batch and the chunks in reverse, v − 1 − (k mod p·v) // p."""
    total = m * v
    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)

    def action(kind: str, k: int) -> str:
        chunk = (k % (p * v)) // p
        return f"{kind}{(k // (p * v)) * p + k % p}.{chunk if kind == 'F' else v - 1 - chunk}"

    order = [action("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action("F", warmup + k), action("B", k)]
    return order + [action("B", k) for k in range(total - warmup, total)]


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 3, 6), (3, 2, 6), (4, 2, 8),
                                           (4, 3, 4), (3, 1, 9)])
def test_every_rank_runs_megatron_lms_order(p, v, m):
    schedule = interleaved_1f1b(p, v, m)
    for rank in range(p):
        assert [str(a) for a in schedule.ranks[rank]] == megatron_order(rank, p, v, m), rank


def test_the_order_is_megatron_lms():
    # p = 2, v = 2, m = 4 by hand: rank 0 warms up with (2 − 0 − 1)·2 + (2 − 1)·2 = 4
    # forwards, rank 1 with 2; forwards go through chunk 0 for micro-batches 0 1, chunk 1
    # for 0 1, then chunk 0 for 2 3, chunk 1 for 2 3; backwards the same with the chunks
    # reversed (B0.1 B1.1 B0.0 B1.0 B2.1 ...)
    schedule = interleaved_1f1b(2, 2, 4)
    assert " ".join(map(str, schedule.ranks[0])) == (
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0")
    assert " ".join(map(str, schedule.ranks[1])) == (
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0")
    assert schedule.virtual_stage(1, 1) == 3


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_every_rank_idles_the_interleaved_bubble(p, v, groups, backward):
    m = groups * p
    timeline = simulate_interleaved(interleaved_1f1b(p, v, m), 1.0, backward)
    expected = (p - 1) / (v * m + p - 1)
    assert [timeline.idle_fraction(r) for r in range(p)] == pytest.approx([expected] * p)
    assert timeline.makespan == pytest.approx((m + (p - 1) / v) * (1.0 + backward))


def test_more_chunks_shrink_the_bubble():
    bubbles = [simulate_interleaved(interleaved_1f1b(4, v, 8)).idle_fraction(0)
               for v in (1, 2, 4)]
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] == pytest.approx(3 / 11)


def test_inputs_exist_before_each_action_runs():
    schedule = interleaved_1f1b(3, 2, 6)
    timeline = simulate_interleaved(schedule)
    end = {}
    for r, runs in enumerate(timeline.runs):
        for action, _, finish in runs:
            end[(action.kind, action.microbatch, schedule.virtual_stage(r, action.chunk))] = finish
    last = 3 * 2 - 1
    for r, runs in enumerate(timeline.runs):
        for action, start, _ in runs:
            k = schedule.virtual_stage(r, action.chunk)
            if action.kind == "F" and k > 0:
                assert end[("F", action.microbatch, k - 1)] <= start
            if action.kind == "B":
                assert end[("F", action.microbatch, k)] <= start
                if k < last:
                    assert end[("B", action.microbatch, k + 1)] <= start


def test_a_deadlock_is_named():
    schedule = interleaved_1f1b(2, 2, 2)
    swapped = (schedule.ranks[1][3], *schedule.ranks[1][:3], *schedule.ranks[1][4:])
    broken = replace(schedule, ranks=(schedule.ranks[0], swapped))
    with pytest.raises(InterleavedScheduleError, match="deadlock"):
        simulate_interleaved(broken)


def test_a_missing_or_repeated_action_is_refused():
    schedule = interleaved_1f1b(2, 2, 2)
    repeated = (*schedule.ranks[0][:-1], ChunkAction("F", 0, 0))
    with pytest.raises(InterleavedScheduleError, match="rank 0 must run every"):
        simulate_interleaved(replace(schedule, ranks=(repeated, schedule.ranks[1])))


@pytest.mark.parametrize("args,message", [
    ((2, 2, 3), "multiple of 2 micro-batches, not 3"),
    ((0, 2, 4), "num_ranks must be an integer ≥ 1"),
    ((2, 0, 4), "num_chunks must be an integer ≥ 1"),
])
def test_bad_sizes_say_what_to_fix(args, message):
    with pytest.raises(ValueError, match=message):
        interleaved_1f1b(*args)


# ---------------------------------------------------------------- the runtime's action lists
@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 3, 6), (3, 2, 6), (4, 2, 8),
                                           (4, 3, 4), (2, 2, 2), (3, 3, 3)])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_the_runtimes_actions_run_on_paper_with_the_interleaved_bubble(p, v, m, backward):
    schedule = interleaved(p, v, m)
    # the checker runs the runtime's semantics: a receive takes the next message of its
    # channel (round the ring) and must be the micro-batch and chunk it expects
    result = simulate(schedule, 1.0, backward)
    expected = (p - 1) / (v * m + p - 1)
    assert [result.idle_fraction(s) for s in range(p)] == pytest.approx([expected] * p)
    order = interleaved_1f1b(p, v, m)
    for rank in range(p):  # Megatron-LM's compute order, chunk 0 written without ".0"
        assert [str(a) for a in schedule.compute(rank)] == [
            str(a).removesuffix(".0") for a in order.ranks[rank]]


def test_messages_wrap_from_the_last_rank_to_the_first():
    # p = 2, v = 2, m = 2: virtual stages 0 and 2 on rank 0, 1 and 3 on rank 1. Rank 0's
    # chunk 1 receives from rank 1's chunk 0 (rA0.1) and sends its gradient back (sG0.1);
    # virtual stage 0 receives nothing and sends no gradient, stage 3 computes the loss
    schedule = interleaved(2, 2, 2)
    assert " ".join(map(str, schedule.actions(0))) == (
        "F0 sA0 F1 sA1 rA0.1 F0.1 sA0.1 rA1.1 F1.1 sA1.1 rG0.1 B0.1 sG0.1 rG1.1 B1.1 sG1.1 "
        "rG0 B0 rG1 B1")
    assert " ".join(map(str, schedule.actions(1))) == (
        "rA0 F0 sA0 rA1 F1 sA1 rA0.1 F0.1 rA1.1 F1.1 B0.1 sG0.1 B1.1 sG1.1 rG0 B0 sG0 rG1 B1 "
        "sG1")
    assert get_schedule("1f1b", 2, 2, 2) == schedule
    grid = format_schedule(schedule)
    assert grid.startswith("interleaved-1f1b: p=2, v=2, m=2, bubble 0.200")


def test_receives_out_of_order_round_the_wrap_are_named():
    schedule = interleaved(2, 2, 4)
    actions = list(schedule.actions(0))
    first, second = [i for i, a in enumerate(actions) if isinstance(a, RecvAct)][:2]
    actions[first], actions[second] = actions[second], actions[first]
    broken = replace(schedule, stages=(tuple(actions), schedule.actions(1)))
    with pytest.raises(ScheduleError, match="the next message from stage 1 carries micro-batch "
                                            "0 for chunk 1"):
        simulate(broken)


def test_gpipe_has_no_interleaved_form():
    with pytest.raises(ValueError, match="schedule 'gpipe' has no interleaved form"):
        get_schedule("gpipe", 2, 4, 2)
