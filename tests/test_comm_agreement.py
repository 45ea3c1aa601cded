"""Every rank's ``auto`` uses rank 0's costs, so ranks never pick different algorithms."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from disttrain.comm import CommConfig, Communicator, LinkCosts
from disttrain.comm.cost_model import save_costs


def _costs_with_rank_files(comm: Communicator) -> tuple[float, float, str]:
    path = os.path.join(tempfile.mkdtemp(prefix="disttrain-cal-"), "calibration.json")
    # each rank stores a different calibration; a tiny alpha makes latency-bound algorithms lose
    save_costs("torch", LinkCosts(alpha=(comm.rank + 1) * 1e-3, gamma=1e-12), path=Path(path))
    old = os.environ.get("DISTTRAIN_CALIBRATION")
    os.environ["DISTTRAIN_CALIBRATION"] = path
    try:
        fresh = Communicator(comm.transport, CommConfig(), owns_transport=False)
    finally:
        if old is None:
            del os.environ["DISTTRAIN_CALIBRATION"]
        else:
            os.environ["DISTTRAIN_CALIBRATION"] = old
    chosen = fresh._algorithm("all_reduce", None, 4096)
    return fresh.costs.alpha, fresh.costs.gamma, chosen


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_adopts_rank0_costs(pools, world_size):
    results = pools(world_size).run(_costs_with_rank_files)
    assert {alpha for alpha, _, _ in results} == {1e-3}, results
    assert {gamma for _, gamma, _ in results} == {1e-12}
    assert len({chosen for _, _, chosen in results}) == 1
