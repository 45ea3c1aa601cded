"""Tensor parallelism measured against its formulas: the bytes the transport counts equal
:mod:`disttrain.parallel.tensor.theory` exactly (TP and SP, tp = 2, 3, 4, buffers that do
and do not divide by tp), and the activations autograd keeps per block equal the
activation formula exactly."""

from __future__ import annotations

import pytest
import torch

from disttrain.parallel.tensor import apply_tensor_parallel
from disttrain.parallel.tensor.theory import (
    Collective,
    LMShape,
    block_activation_bytes,
    bytes_sent,
    ring_bytes_sent,
    tp_step_collectives,
)
from tests.tensor_parallel_cases import D_MODEL, HEADS, LAYERS, SEQ, VOCAB, batches, make_model

SHAPE = LMShape(VOCAB, D_MODEL, HEADS, LAYERS, SEQ)


def step_traffic(comm, sequence_parallel: bool, seq: int) -> tuple[dict, dict]:
    """One training step's bytes and calls per collective, counted by the transport, and
    the formula's for this rank."""
    model = apply_tensor_parallel(make_model(), comm, sequence_parallel, algorithm="ring")
    x, y = batches(rows=3, steps=1, seq=seq)[0]
    before = comm.stats.snapshot()
    loss = model.loss(model(x), y)
    loss.backward()
    model.reduce_sequence_parallel_grads()
    after = comm.stats.snapshot()
    measured = {op: (after[op]["bytes_sent"] - before.get(op, {}).get("bytes_sent", 0),
                     after[op]["calls"] - before.get(op, {}).get("calls", 0))
                for op in after if after[op] != before.get(op)}
    expected: dict[str, tuple[int, int]] = {}
    for c in tp_step_collectives(SHAPE, 3, seq, comm.world_size, sequence_parallel):
        sent, calls = expected.get(c.op, (0, 0))
        expected[c.op] = (sent + bytes_sent([c], comm.world_size, comm.rank), calls + 1)
    return measured, expected


@pytest.mark.parametrize(("tp", "sequence_parallel", "seq"), [
    (2, False, 12), (2, True, 12), (3, False, 10), (3, True, 12), (4, False, 9),
    (4, True, 8)])
def test_bytes_counted_by_the_transport_equal_the_formula(pools, tp, sequence_parallel, seq):
    for measured, expected in pools(tp).run(step_traffic, sequence_parallel, seq):
        assert measured == expected


def saved_per_block(comm, sequence_parallel: bool) -> list[int]:
    """Bytes autograd saves in each block's forward (parameters left out, each storage
    once), measured with saved-tensor hooks."""
    model = apply_tensor_parallel(make_model(), comm, sequence_parallel)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = model[0](batches(rows=3, steps=1)[0][0])
    counts = []
    for block in list(model)[1:-2]:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen=seen) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen.setdefault(storage.data_ptr(), storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = block(x)
        counts.append(sum(seen.values()))
    return counts


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_activation_bytes_per_block_equal_the_formula(pools, tp, sequence_parallel):
    expected = block_activation_bytes(SEQ, 3, D_MODEL, HEADS, tp, sequence_parallel)
    for counts in pools(tp).run(saved_per_block, sequence_parallel):
        assert counts == [expected] * LAYERS


# ---------------------------------------------------------------- pure functions
def test_one_rank_of_the_formula_is_the_single_process_model():
    """tp = 1 counts what the unsplit model's block saves (measured in process)."""
    model = make_model()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    x = model[0](batches(rows=3, steps=1)[0][0])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model[1](x)
    assert sum(seen.values()) == block_activation_bytes(SEQ, 3, D_MODEL, HEADS, 1, False)


def test_sequence_parallelism_saves_the_layernorm_activations():
    s, b, h, a, t = 2048, 1, 4096, 32, 8  # fp32 elements
    saved = (block_activation_bytes(s, b, h, a, t, False)
             - block_activation_bytes(s, b, h, a, t, True))
    assert saved == 4 * (2 * s * b * h + 4 * s * b) * (t - 1) // t


def test_ring_bytes_per_rank():
    assert [ring_bytes_sent("all_reduce", 2, 10, 4, r) for r in (0, 1)] == [40, 40]
    # 10 elements over 3 ranks: segments 4, 3, 3; rank r skips segments r+1 and r+2
    assert [ring_bytes_sent("all_reduce", 3, 10, 1, r) for r in (0, 1, 2)] == [14, 13, 13]
    assert ring_bytes_sent("all_reduce", 4, 400, 4, 0) == 2 * 3 * 400
    assert ring_bytes_sent("reduce_scatter", 4, 400, 4, 3) == 3 * 100 * 4
    assert ring_bytes_sent("all_gather", 1, 400, 4, 0) == 0
    with pytest.raises(ValueError, match="equal blocks"):
        ring_bytes_sent("all_gather", 3, 10, 4, 0)


def test_sequence_parallelism_moves_what_tensor_parallelism_moves():
    """Per block, SP's reduce-scatters and all-gathers send what TP's all-reduces send;
    SP adds only its once-per-step gradient all-reduce."""
    for t in (2, 4, 8):
        tp = bytes_sent(tp_step_collectives(SHAPE, 4, 16, t, False), t, 0)
        sp = tp_step_collectives(SHAPE, 4, 16, t, True)
        grads = [c for c in sp if c.where == "sequence-parallel gradients"]
        assert grads == [Collective("all_reduce", SHAPE.sequence_parallel_params(), 4,
                                    "sequence-parallel gradients")]
        assert bytes_sent([c for c in sp if c not in grads], t, 0) == tp


def test_collectives_per_block():
    """Four of b·s·h per block and step (2 forward, 2 backward), one each for the embedding
    and the head, two for the loss."""
    plan = tp_step_collectives(SHAPE, 4, 16, 2, False)
    act = 4 * 16 * D_MODEL
    assert [c.numel for c in plan].count(act) == 4 * LAYERS + 2
    assert sorted(c.numel for c in plan if c.numel != act) == [64, 128]
    assert tp_step_collectives(SHAPE, 4, 16, 1, True) == []


def test_bytes_sent_takes_the_algorithms_price_where_it_differs_from_the_ring():
    cs = [Collective("reduce_scatter", 400, 4, "rs"), Collective("all_gather", 400, 4, "ag")]
    ring = bytes_sent(cs, 2, 0)
    assert ring == 2 * 200 * 4
    shm = {"reduce_scatter": lambda n: float(n), "all_gather": lambda n: n / 2}
    assert bytes_sent(cs, 2, 0, lambda op, n: shm[op](n)) == 1600 + 800
    assert bytes_sent(cs, 2, 0, lambda op, n: None) == ring  # native: the ring's figure
