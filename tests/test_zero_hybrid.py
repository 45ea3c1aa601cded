"""Hybrid sharding: ZeRO inside shard groups of S ranks, all-reduce across R replicas, on a
2 × 2 mesh of 4 ranks: equal to one float64 process; bytes per communicator equal the
formula; memory by the formula over S; checkpoints written once and loaded on any layout."""

from __future__ import annotations

import pytest
import torch

from disttrain.parallel import zero
from disttrain.parallel.zero import formula, ring_step_bytes
from tests import zero_hybrid_cases as cases

STEPS = 3


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {opt: cases.reference(opt, STEPS) for opt in ("sgd", "adam")}


def assert_params(per_rank, expected) -> None:
    for rank, params in enumerate(per_rank):
        assert params.keys() == expected.keys()
        for name, value in params.items():
            assert value.dtype == torch.float64, (rank, name)
            torch.testing.assert_close(value, expected[name],
                                       msg=lambda m, n=name, r=rank: f"rank {r}, {n}: {m}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_2x2_equals_one_process_and_sends_the_formula(pools, references, stage):
    micro = 1 if stage == 1 else 3  # stages 2 and 3 reduce (and all-reduce) per micro-batch
    for optimizer in ("sgd", "adam"):
        per_rank = pools(4).run(cases.run_equivalence, stage, optimizer, STEPS, micro)
        assert_params([r["params"] for r in per_rank], references[optimizer])
        for rank, result in enumerate(per_rank):
            # shard groups {0, 1} {2, 3}; replicate groups {0, 2} {1, 3}
            assert result["groups"] == ((rank - rank % 2, rank - rank % 2 + 1),
                                        (rank % 2, rank % 2 + 2))
            # each communicator counts its own bytes: intra (reduce-scatter, all-gathers over
            # S) and inter (all-reduce of the gradient shard over R), each the formula's
            assert (result["intra"], result["inter"]) == pytest.approx(result["theory"])
            assert result["theory"] == pytest.approx(result["ring"])
            assert result["inter"] > 0 and result["intra"] > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_memory_is_the_formula_over_the_shard_group(pools, stage):
    per_rank = pools(4).run(cases.run_memory, stage)
    psi = per_rank[0]["numel"]
    expected = formula(stage, psi, 4, param_bytes=4, grad_bytes=4, optimizer_bytes=8,
                       dp_shard=2)
    for rank, result in enumerate(per_rank):
        assert result["formula"] == expected.as_dict()
        for part in ("params", "grads", "optimizer", "total"):
            assert result["measured"][part] == pytest.approx(expected.as_dict()[part],
                                                             rel=0.01), (rank, part)


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_checkpoint_is_written_once_and_loads_on_any_layout(pools, tmp_path, stage):
    saved = tmp_path / "saved"
    # the first replica (ranks 0, 1) writes, the second (2, 3) holds the same shards
    assert pools(4).run(cases.run_save, stage, "adam", STEPS, str(saved)) == [1, 1, 0, 0]
    # the shard group's 2 ranks wrote: a checkpoint of ZeRO on 2 ranks
    assert sorted(p.name for p in saved.iterdir()) == [
        "manifest.json", "rank-00000.json", "rank-00000.pt", "rank-00001.json", "rank-00001.pt"]
    params, _ = zero.consolidate(saved)
    want = cases.reference("adam", STEPS)
    for name, value in params.items():
        torch.testing.assert_close(value, want[name])
    later = cases.reference("adam", 2 * STEPS)
    for world, replicas in ((4, 2), (2, 1)):  # hybrid again, and plain ZeRO on 2 ranks
        per_rank = pools(world).run(cases.run_resume, stage, "adam", STEPS, 2 * STEPS,
                                    str(saved), replicas)
        assert_params(per_rank, later)


# ---------------------------------------------------------------- pure: the formulas
def test_memory_formula_divides_by_the_shard_group():
    psi, sizes = 1200, {"param_bytes": 2, "grad_bytes": 2, "optimizer_bytes": 12}
    hybrid = formula("zero3", psi, 8, dp_shard=2, **sizes)
    assert hybrid == formula("zero3", psi, 2, **sizes)  # what ZeRO on S ranks holds
    assert hybrid.total == 16 * psi // 2
    assert formula("zero2", psi, 8, dp_shard=4, **sizes).total == 2 * psi + 14 * psi // 4
    assert formula("zero1", psi, 8, dp_shard=8, **sizes) == formula("zero1", psi, 8, **sizes)
    for bad in (3, 0, True):
        with pytest.raises(ValueError, match="dp_shard must be an int ≥ 1 that divides"):
            formula("zero3", psi, 8, dp_shard=bad, **sizes)


def test_ring_step_bytes_splits_intra_and_inter():
    # Ψ = 1000 padded elements, bf16 (2 bytes), S = 4, R = 2, one micro-batch
    stage3 = ring_step_bytes(3, 1000, 4, 2, param_bytes=2, reduce_bytes=2)
    assert stage3.intra == 3 / 4 * 1000 * (2 + 2 * 2)  # reduce-scatter + 2 all-gathers
    assert stage3.inter == 2 * 1 / 2 * 1000 / 4 * 2  # all-reduce of the 250-element shard
    stage2 = ring_step_bytes(2, 1000, 4, 2, param_bytes=2, reduce_bytes=2, accumulate=3)
    assert stage2.intra == 3 / 4 * 1000 * (3 * 2 + 2) and stage2.inter == 3 * 250 * 2 * 1 / 2 * 2
    plain = ring_step_bytes(1, 1000, 8, param_bytes=4, reduce_bytes=4)
    assert plain.inter == 0 and plain.total == 2 * 7 / 8 * 4000  # DDP's all-reduce
    with pytest.raises(ValueError, match="dp_replicate must be ≥ 1"):
        ring_step_bytes(3, 1000, 4, 0, param_bytes=2, reduce_bytes=2)
