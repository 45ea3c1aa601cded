"""Sharded checkpoints: save on N ranks, resume on M ≠ N (and on another stage), continue, and
match the uninterrupted single-process run in parameters and optimizer state."""

from __future__ import annotations

import json
import math

import pytest
import torch

from disttrain.parallel import zero
from tests import zero_cases

STEPS = 3


def assert_state_matches(directory, optimizer: str, steps: int) -> None:
    """Consolidate a checkpoint offline and compare it with the reference after ``steps``."""
    params, state = zero.consolidate(directory)
    ref_params, ref_state = zero_cases.reference(optimizer, steps)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], msg=lambda m, n=name: f"{n}: {m}")
        assert state[name].keys() == ref_state[name].keys()
        for key, expected in ref_state[name].items():
            torch.testing.assert_close(state[name][key].to(expected.dtype), expected,
                                       msg=lambda m, n=name, k=key: f"{n} state {k}: {m}")


def assert_params(per_rank, optimizer: str, steps: int) -> None:
    expected, _ = zero_cases.reference(optimizer, steps)
    for result in per_rank:
        for name, value in result["loaded"].items():
            torch.testing.assert_close(value, expected[name])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_on_4_resume_on_2_and_3(pools, tmp_path, stage):
    saved = tmp_path / "saved"
    pools(4).run(zero_cases.run_save, stage, "adam", STEPS, str(saved))
    assert_state_matches(saved, "adam", STEPS)
    for world_size in (2, 3):
        out = tmp_path / f"resumed-on-{world_size}"
        per_rank = pools(world_size).run(zero_cases.run_resume, stage, "adam", STEPS,
                                         2 * STEPS, str(saved), str(out))
        assert_params(per_rank, "adam", STEPS)  # right after loading
        assert_state_matches(out, "adam", 2 * STEPS)  # and after K more steps


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_on_2_resume_on_4(pools, tmp_path, stage):
    saved, out = tmp_path / "saved", tmp_path / "resumed"
    pools(2).run(zero_cases.run_save, stage, "sgd", STEPS, str(saved))
    per_rank = pools(4).run(zero_cases.run_resume, stage, "sgd", STEPS, 2 * STEPS, str(saved),
                            str(out))
    assert_params(per_rank, "sgd", STEPS)
    assert_state_matches(out, "sgd", 2 * STEPS)


@pytest.mark.parametrize(("save", "resume"), [((1, 4), (3, 3)), ((3, 3), (2, 2))])
def test_resume_on_another_stage(pools, tmp_path, save, resume):
    """Groups are matched by parameter name, so stage 1's one group refills stage 3's
    units and the other way round."""
    saved, out = tmp_path / "saved", tmp_path / "resumed"
    pools(save[1]).run(zero_cases.run_save, save[0], "adam", STEPS, str(saved))
    pools(resume[1]).run(zero_cases.run_resume, resume[0], "adam", STEPS, 2 * STEPS,
                         str(saved), str(out))
    assert_state_matches(out, "adam", 2 * STEPS)


def test_each_new_rank_reads_only_the_old_shards_it_overlaps(pools, tmp_path):
    """191 elements: old shards of 48 on 4 ranks; new shards of 96 on 2 ranks, so new rank 0
    needs old ranks 0-1 and new rank 1 old ranks 2-3: nobody reads everything."""
    saved, out = tmp_path / "saved", tmp_path / "resumed"
    pools(4).run(zero_cases.run_save, 1, "adam", STEPS, str(saved))
    per_rank = pools(2).run(zero_cases.run_resume, 1, "adam", STEPS, STEPS, str(saved),
                            str(out))
    assert [r["opened"] for r in per_rank] == [[0, 1], [2, 3]]
    # each rank wrote its slices and their record; rank 0's shard holds 48 elements
    assert sorted(p.name for p in saved.iterdir()) == ["manifest.json"] + [
        f"rank-{r:05d}.{ext}" for r in range(4) for ext in ("json", "pt")]
    records = json.loads((saved / "rank-00000.json").read_text())["tensors"]
    assert sum(math.prod(sizes) for r in records.values() if r["kind"] == "param"
               for _, sizes in r["chunks"]) == 48


def test_load_rejects_a_different_model(pools, tmp_path):
    saved = tmp_path / "saved"
    pools(2).run(zero_cases.run_save, 1, "adam", 1, str(saved))
    errors = pools(2).run(zero_cases.run_load_wrong_model, str(saved))
    assert all("parameter body.0.weight has shape (12, 5) here but (11, 5)" in e
               for e in errors), errors


def test_incomplete_checkpoint_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"has no manifest\.json: its save did not finish"):
        zero.consolidate(tmp_path)


def test_a_checkpoint_in_the_format_before_the_universal_one_still_reshards(pools, tmp_path):
    """``zero.json`` and a shard file per rank, written by stage 2 on 2 ranks, resume as
    stage 3 on 3 and continue as the uninterrupted run."""
    from tests.checkpoint_cases import rank_save_zero_format

    saved, out = tmp_path / "saved", tmp_path / "resumed"
    pools(2).run(rank_save_zero_format, 2, STEPS, str(saved))
    assert_state_matches(saved, "adam", STEPS)  # consolidate reads the old format too
    per_rank = pools(3).run(zero_cases.run_resume, 3, "adam", STEPS, 2 * STEPS, str(saved),
                            str(out))
    assert_params(per_rank, "adam", STEPS)
    assert_state_matches(out, "adam", 2 * STEPS)
