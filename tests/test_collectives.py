"""Every collective × algorithm × world size × dtype × size agrees with torch.distributed."""

from __future__ import annotations

import pytest

from disttrain.comm import COLLECTIVES
from tests import collective_cases

WORLD_SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", COLLECTIVES)
def test_every_algorithm_matches_torch(pools, op, world_size):
    per_rank = pools(world_size).run(collective_cases.check_collective, op)
    errors = [e for rank_errors in per_rank for e in rank_errors]
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reduce_op", ["prod", "min", "max", "avg"])
@pytest.mark.parametrize("op", ["all_reduce", "reduce", "reduce_scatter"])
def test_reduce_ops(pools, op, reduce_op, world_size):
    per_rank = pools(world_size).run(
        collective_cases.check_collective, op, ["float32", "int64", "bfloat16"], reduce_op,
        [1, 13, 1001])
    errors = [e for rank_errors in per_rank for e in rank_errors]
    assert not errors, "\n".join(errors[:20])
