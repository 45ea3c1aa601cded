"""ZeRO stages 1, 2, 3 on N ∈ {2, 3, 4} real ranks match one process on the whole batch."""

from __future__ import annotations

import re

import pytest
import torch

from tests import zero_cases

STEPS = 4


def assert_matches(per_rank: list[dict[str, torch.Tensor]], expected: dict[str, torch.Tensor],
                   **tolerance: float) -> None:
    for rank, params in enumerate(per_rank):
        assert params.keys() == expected.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, expected[name], **tolerance,
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {opt: zero_cases.reference(opt, STEPS)[0] for opt in zero_cases.OPTIMIZERS}


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage_matches_single_process(pools, references, stage, world_size):
    for optimizer in ("sgd", "adam"):
        per_rank = pools(world_size).run(zero_cases.run_equivalence, stage, optimizer, STEPS)
        assert_matches(per_rank, references[optimizer])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_adamw_and_gradient_accumulation(pools, references, stage):
    """Weight decay must not leak through the padding; 3 micro-batches accumulate."""
    per_rank = pools(2).run(zero_cases.run_equivalence, stage, "adamw", STEPS, 4 << 20, 3)
    assert_matches(per_rank, references["adamw"])


def test_stage2_many_small_buckets(pools, references):
    """Tiny buckets: several reduce-scatters per backward, launched in bucket order."""
    for world_size in (3, 4):
        per_rank = pools(world_size).run(zero_cases.run_equivalence, 2, "adam", STEPS, 64)
        assert_matches(per_rank, references["adam"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_repeated_unit_inplace_activation_and_eval(pools, stage):
    """A layer used three times per forward (gathered and freed each time, re-gathered for
    backward), an in-place ReLU on a unit's output, then a no_grad forward."""
    steps = 3
    expected = zero_cases.reference_loop(steps)
    per_rank = pools(3).run(zero_cases.run_loop, stage, steps)
    assert_matches([r["params"] for r in per_rank], expected)
    torch.manual_seed(0)
    model = zero_cases.Loop()
    model.load_state_dict(expected)
    with torch.no_grad():
        out = model(zero_cases.batch(0)[0])
    for result in per_rank:
        torch.testing.assert_close(result["eval"], out)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_on_some_ranks_only_with_accumulation(pools, stage):
    """Two gates used on rank 1 only (no gradient on rank 0) and two micro-batches
    accumulated without ``no_sync``: every rank must issue the same reductions in the same
    order (no hang, no reduction paired with another bucket's or unit's) and the result is
    the average of each rank's gradient, zero where it has none. Stage 2 with one bucket
    and with several; stage 3 with five units, whose backward gathers interleave with the
    reductions."""
    expected = zero_cases.reference_gated(STEPS, 2, micro=2)
    for bucket_bytes in (4 << 20, 256) if stage == 2 else (4 << 20,):
        per_rank = pools(2).run(zero_cases.run_gated, stage, STEPS, 2, bucket_bytes)
        assert_matches(per_rank, expected)


def test_stage2_gradient_after_its_bucket_was_reduced_is_an_error(pools):
    """A gradient reaching a bucket already reduced in this backward (reentrant
    checkpointing of a parameter also used outside it) would be lost: an error names it
    (the weight's or the bias's, whichever autograd accumulates first)."""
    for message in pools(2).run(zero_cases.run_reentrant_checkpoint):
        assert re.search(r"parameter '1\.(weight|bias)' received a gradient after its bucket "
                         r"was reduced", message), message
        assert "use_reentrant=False" in message


def test_stage1_adopts_gradients_after_model_zero_grad(pools, references):
    """``model.zero_grad()`` drops stage 1's gradient views; autograd's fresh ``.grad``
    tensors must be copied back into the flat buffer before the reduce-scatter."""
    per_rank = pools(3).run(zero_cases.run_equivalence, 1, "sgd", STEPS, 4 << 20, 2, True)
    assert_matches(per_rank, references["sgd"])
