"""ZeRO over the dp groups of a tensor-parallel mesh (``3d --zero 1|2|3``) trains the
TransformerLM to the single process's parameters (fp32 Adam, within 1e-5 relative), with
every rank's bytes per step equal to the formula (ring); ZeRO-2 and 3 with sequence
parallelism sum its gradients on the reduced shards; the model-state bytes are ZeRO's
formula for the rank's tp slice; clipping takes the global norm (float64)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disttrain.train import ParallelOptions
from tests.test_tensor_parallel_strategies import CONFIG, RING, check, rank_train
from tests.test_tensor_parallel_strategies import reference as reference  # the fixture
from tests.test_train_clipping import MAX_NORM, norms_and_state
from tests.test_train_float64 import MESH

DP2_TP2 = {"dp_size": 2, "tp_size": 2, **RING}


@pytest.mark.parametrize(("options", "accumulate"), [
    ({"zero": 3, **DP2_TP2}, 1),
    ({"zero": 3, "sequence_parallel": True, **DP2_TP2}, 2),
    ({"zero": 2, "sequence_parallel": True, **DP2_TP2}, 1),
], ids=["zero3", "zero3-sp-accumulate2", "zero2-sp"])
def test_zero_inside_the_mesh_equals_single_process(pools, reference, options, accumulate):
    config = dataclasses.replace(CONFIG, strategy="3d", accumulate=accumulate,
                                 parallel=ParallelOptions(**options))
    per_rank = pools(4).run(rank_train, config)
    check(per_rank, reference)
    for _, result in per_rank:  # ZeRO's formula for this rank's shard of its tp slice
        measured = result.extras["model_state_bytes"]
        formula = result.extras["model_state_bytes_formula"]
        assert formula["total"] <= measured["total"] <= formula["total"] * 1.05, (
            measured, formula)  # above by the padding of the flat groups only


def test_clipping_under_zero3_in_the_mesh_takes_the_global_norm(pools):
    """float64 SGD: a wrong norm would move the parameters by its own factor."""
    config = dataclasses.replace(MESH, clip_grad_norm=MAX_NORM, strategy="3d",
                                 parallel=ParallelOptions(dp_size=2, tp_size=2, zero=3,
                                                          sequence_parallel=True))
    single = dataclasses.replace(config, strategy="single", parallel=ParallelOptions())
    want_norms, want = norms_and_state(None, single)
    assert all(n > MAX_NORM for n in want_norms)
    for rank, (norms, state) in enumerate(pools(4).run(norms_and_state, config)):
        assert norms == pytest.approx(want_norms, rel=1e-10), rank
        for name, value in state.items():
            torch.testing.assert_close(value, want[name], rtol=1e-9, atol=1e-12,
                                       msg=f"rank {rank} {name}")


def test_zero3_with_context_parallelism_is_refused_in_one_line():
    from disttrain.train.strategies import get_strategy

    config = dataclasses.replace(CONFIG, strategy="3d", parallel=ParallelOptions(
        dp_size=2, cp_size=2, zero=3))
    with pytest.raises(ValueError, match="--zero 3 drops each gradient") as exc:
        get_strategy("3d").check_config(config, 4)
    assert "\n" not in str(exc.value)

