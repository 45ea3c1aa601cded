"""Interleaved 1F1B as data, checked without processes: dependency order, no deadlock,
every (micro-batch, chunk) once, and the bubble (p − 1)/(v·m + p − 1)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.parallel.pipeline.schedules import (
    ChunkAction,
    InterleavedScheduleError,
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
