"""Context parallelism without processes: the zig-zag split and the ring's schedule as data
(checked against the causal mask they must cover), the byte and activation formulas
against hand counts, and the one-line errors."""

from __future__ import annotations

import types

import pytest
import torch

from disttrain.parallel.context import (
    apply_context_parallel,
    attention_activation_bytes,
    attention_bytes_sent,
    bytes_sent,
    positions,
    ring_schedule,
    split_sequence,
    work_blocks,
)
from disttrain.parallel.context.layout import natural_order, rank_order
from disttrain.parallel.context.theory import ring_all_reduce_bytes
from disttrain.train.transformer import TransformerLM


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_split_gives_every_position_once(cp):
    length = 4 * cp
    held = [positions(length, r, cp) for r in range(cp)]
    assert sorted(p for rank in held for p in rank) == list(range(length))
    for rank in held:  # each rank's positions increase: causal masking is a lower triangle
        assert rank == sorted(rank)
    tokens = torch.arange(length).repeat(2, 1)
    for r in range(cp):
        assert split_sequence(tokens, r, cp).tolist() == [held[r]] * 2


def test_zigzag_split_pairs_front_and_back_chunks():
    assert positions(12, 0, 3) == [0, 1, 10, 11]
    assert positions(12, 1, 3) == [2, 3, 8, 9]
    assert positions(12, 2, 3) == [4, 5, 6, 7]
    assert rank_order(3) == [0, 5, 1, 4, 2, 3]
    gathered = rank_order(3)
    assert [gathered[i] for i in natural_order(3)] == list(range(6))


@pytest.mark.parametrize("cp", [2, 3, 4, 5])
def test_zigzag_balances_causal_work(cp):
    assert work_blocks(cp) == [2 * cp + 1] * cp
    contiguous = work_blocks(cp, zigzag=False)
    assert contiguous == [4 * r + 3 for r in range(cp)]  # the last rank does most
    assert sum(contiguous) == sum(work_blocks(cp))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_schedule_covers_exactly_the_causal_pairs(cp):
    """Each rank's steps, unfolded into (query position, key position) pairs, are the
    causal pairs of its queries: nothing missed, nothing twice, nothing in the future."""
    c = 2
    length = 2 * cp * c
    for r in range(cp):
        mine = positions(length, r, cp)
        seen: list[tuple[int, int]] = []
        steps = ring_schedule(r, cp)
        assert [s.src for s in steps] == [(r - s) % cp for s in range(cp)]
        for step in steps:
            theirs = positions(length, step.src, cp)
            rows = mine[step.queries.start * c:step.queries.stop * c]
            keys = theirs[step.keys.start * c:step.keys.stop * c]
            for i, q in enumerate(rows):
                for j, k in enumerate(keys):
                    if not step.causal or j <= i + (len(keys) - len(rows)):
                        seen.append((q, k))
        expected = [(q, k) for q in mine for k in range(length) if k <= q]
        assert sorted(seen) == sorted(expected)
        if cp > 1:  # every step after the first is half a block: balanced
            assert all((s.queries.stop - s.queries.start) * (s.keys.stop - s.keys.start) == 2
                       for s in steps[1:])


def test_a_sequence_that_does_not_split_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"divisible by 6 \(--seq-len\)") as info:
        split_sequence(torch.zeros(2, 10, dtype=torch.long), 0, 3)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="divisible by 4"):
        positions(6, 1, 2)


def _fake_comm(world_size: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(world_size=world_size, rank=0)


def test_ulysses_needs_heads_that_divide_and_the_model_must_be_a_transformer():
    model = TransformerLM(16, 12, d_model=16, n_heads=4, n_layers=1)
    with pytest.raises(ValueError, match=r"4 attention heads .* cp=3") as info:
        apply_context_parallel(model, _fake_comm(3), "ulysses")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="variant 'striped' is unknown"):
        apply_context_parallel(model, _fake_comm(2), "striped")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"TransformerLM .* --model transformer"):
        apply_context_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)),
                               _fake_comm(2))  # type: ignore[arg-type]


def test_bytes_formulas_by_hand():
    # b = 2, s = 12, h = 24, cp = 3: a = 2·4·24 = 192 elements; fp64
    a, e = 192, 8
    ring = attention_bytes_sent("ring", 3, 2, 12, 24, 1, e)
    assert ring == 2 * a * e * 2 + 2 * (2 * a * e + 2 * a * e)  # fwd 2 KV; bwd 2 KV, 2 dKV
    ulysses = attention_bytes_sent("ulysses", 3, 2, 12, 24, 1, e)
    assert ulysses == 2 * (2 / 3 * 3 * a + 2 / 3 * a) * e  # q,k,v and out, both ways
    assert attention_bytes_sent("ring", 1, 2, 12, 24, 1, e) == 0
    # bf16 activations (a = 1·2·2 = 4): dKV still travels in fp32
    assert attention_bytes_sent("ring", 2, 1, 4, 2, 1, 2) == 8 * 2 + (8 * 2 + 8 * 4)
    # the ring all-reduce: 10 elements over 3 ranks cut 4, 3, 3
    assert [ring_all_reduce_bytes(10, 3, r, 1) for r in range(3)] == [14, 13, 13]
    assert ring_all_reduce_bytes(10, 2, 0, 4) == 40
    total = bytes_sent("ring", 3, 1, batch=2, seq=12, hidden=24, n_layers=2, params=10,
                       element_size=8, param_element_size=4, micro_batches=2)
    assert total == 2 * 2 * ring + 13 * 4


def test_attention_activations_shrink_by_cp():
    single = attention_activation_bytes(2, 12, 24, 6, 1, 8)
    assert single == 5 * 2 * 12 * 24 * 8 + 2 * 12 * 6 * 8
    for cp in (2, 3):
        assert attention_activation_bytes(2, 12, 24, 6, cp, 8) * cp == single
        ulysses = attention_activation_bytes(2, 12, 24, 6, cp, 8, "ulysses")
        assert ulysses * cp == single + 2 * 12 * 24 * 8  # its output kept twice
