"""Shared fixtures: process pools (starting ranks is slow on 2 cores, so each world size starts
once) and a real single-node Slurm for the launcher tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.dist import DistPool


class Pools:
    def __init__(self) -> None:
        self._pools: dict[int, DistPool] = {}

    def __call__(self, world_size: int) -> DistPool:
        if world_size not in self._pools:
            self._pools[world_size] = DistPool(world_size)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    shared = Pools()
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real single-node Slurm (munged, slurmctld, slurmd) for this session; skipped, with
    the reason, where it cannot run (not installed, not root). Stopped by pid at the end."""
    from tests.slurm_cluster import SlurmCluster, Unavailable

    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except Unavailable as exc:
        cluster.stop()
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()
