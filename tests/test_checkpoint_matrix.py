"""One checkpoint for every strategy: a checkpoint written under one strategy and world size
loads under another and the run continues bit for bit (fp32) as the uninterrupted one.

Each case is a pair (B, A). B trains 4 steps, checkpointing at 2 and 4: the uninterrupted
run. A loads B's step-2 checkpoint on its own ranks and writes it again untouched
(:func:`tests.checkpoint_cases.rank_rewrite`), so everything the next run gets went through
A's reading and A's writing of its own slices; B resumes from A's checkpoint and trains
steps 3 and 4. A's checkpoint must hold B's step-2 state bit for bit, and the resumed run
must end with B's step-4 state bit for bit (parameters, Adam's moments and steps) after the
same losses. Two more checks keep a mistake from cancelling itself out on the way in and
out: the parameters A holds after loading, gathered by A's own code, are B's; and A itself
continues from B's checkpoint to the state B reaches, within the float tolerance of the
equivalence tests (‖a − b‖/‖b‖ < 1e-5 for every parameter and moment: A's sums run in
another order), which a misplaced optimizer moment misses by orders of magnitude.

Both sides of every pair read and write, so the pairs below cover ddp, zero1-3, hybrid
ZeRO (2 × 2), 1f1b (2 and 3 stages, and interleaved), tp, tp-sp, 3d (dp × tp with
ZeRO-1, tp × pp) and expert parallelism (the mixture-of-experts model) across world sizes
2 ↔ 3 and 2 ↔ 4: a representative matrix, not all N².
"""

from __future__ import annotations

import shutil

import pytest

from tests.checkpoint_cases import (
    Layout,
    assert_identical,
    merged,
    rank_rewrite,
    rank_train,
    state,
)
from tests.tensor_parallel_cases import worst_relative_error

M4 = (("microbatches", 4),)
PAIRS = [
    (Layout("ddp", 2), Layout("zero3", 3)),
    (Layout("zero2", 3), Layout("1f1b", 2, M4)),
    (Layout("1f1b", 3, M4), Layout("tp", 2)),
    (Layout("tp-sp", 2), Layout("3d", 4, (("dp_size", 2), ("tp_size", 2), ("zero", 1)))),
    (Layout("3d", 4, (("tp_size", 2), ("pp_size", 2), *M4)), Layout("zero2", 2)),
    (Layout("zero3", 2), Layout("ddp", 3)),
    (Layout("zero2", 4, (("dp_shard", 2),)), Layout("1f1b", 2, (*M4, ("virtual_stages", 2)))),
    (Layout("ep", 2, model="transformer-moe"), Layout("ddp", 3, model="transformer-moe")),
]


@pytest.mark.parametrize(("writer", "reader"), PAIRS, ids=[f"{b}-{a}" for b, a in PAIRS])
def test_a_checkpoint_read_and_rewritten_by_another_strategy_continues_bit_exactly(
        pools, tmp_path, writer, reader):
    whole, source, rewritten = tmp_path / "whole", tmp_path / "source", tmp_path / "rewritten"
    losses = pools(writer.world).run(rank_train, writer.config(whole))[0]
    shutil.copytree(whole / "step-00000002", source / "step-00000002")
    (source / "latest").write_text("step-00000002")

    rewrites = pools(reader.world).run(rank_rewrite, reader.config(source), str(rewritten))
    assert [step for step, _ in rewrites] == [2] * reader.world
    before = state(whole / "step-00000002")
    held = merged([params for _, params in rewrites])
    assert_identical(held, {name: before[name] for name in held}, f"{reader} loaded")
    assert len(held) == len([n for n in before if "/" not in n])
    assert_identical(state(rewritten / "step-00000002"), before,
                     f"{reader} rewrote {writer}'s checkpoint")

    resumed = pools(writer.world).run(rank_train, writer.config(rewritten, resume=True))[0]
    assert resumed == losses[2:]
    after = state(whole / "step-00000004")
    assert_identical(state(rewritten / "step-00000004"), after,
                     f"{writer} resumed from {reader}'s checkpoint")

    pools(reader.world).run(rank_train, reader.config(source, resume=True))
    err, name = worst_relative_error(state(source / "step-00000004"), after)
    assert err < 1e-5, f"{reader} continued from {writer}'s checkpoint: {name} off by {err:.2g}"
