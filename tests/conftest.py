"""Shared fixtures: process pools (starting ranks is slow on 2 cores, so each world size starts
once) and a real single-node Slurm for the launcher tests.

Tests marked ``@pytest.mark.nccl_rules`` run twice: on the plain pools (``[gloo]``) and on
pools whose communicators match messages by NCCL's rules (``[nccl-rules]``,
:mod:`disttrain.comm.nccl_rules`). ``DISTTRAIN_NCCL_RULES=1 pytest`` runs every test under
the rules.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.dist import DistPool

MODES = {"gloo": None, "nccl-rules": True}  # id → DistPool(nccl_rules=...) (None: the env's)


class Pools:
    def __init__(self, nccl_rules: bool | None = None) -> None:
        self._pools: dict[int, DistPool] = {}
        self.nccl_rules = nccl_rules

    def __call__(self, world_size: int) -> DistPool:
        if world_size not in self._pools:
            self._pools[world_size] = DistPool(world_size, nccl_rules=self.nccl_rules)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "nccl_rules: run the test on the plain pools and again "
                                       "under NCCL's matching rules (disttrain.comm.nccl_rules)")
    # The suite never reads this machine's calibration (~/.cache/disttrain): with one,
    # "auto" picks other algorithms than on a fresh machine (a broadcast of DDP's buffers
    # that Gloo's native call hides from the byte counters becomes disttrain's own, and
    # counted), so results would depend on who ran `bench comm --calibrate` here. Tests
    # that calibrate set their own path.
    if "DISTTRAIN_CALIBRATION" not in os.environ:
        scratch = tempfile.mkdtemp(prefix="disttrain-tests-calibration-")
        atexit.register(shutil.rmtree, scratch, True)
        os.environ["DISTTRAIN_CALIBRATION"] = os.path.join(scratch, "none.json")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pools" in metafunc.fixturenames and metafunc.definition.get_closest_marker("nccl_rules"):
        metafunc.parametrize("pools", list(MODES), indirect=True)


@pytest.fixture(scope="session")
def _all_pools() -> Iterator[dict[str, Pools]]:
    shared = {mode: Pools(rules) for mode, rules in MODES.items()}
    yield shared
    for pools in shared.values():
        pools.close()


@pytest.fixture
def pools(request: pytest.FixtureRequest, _all_pools: dict[str, Pools]) -> Pools:
    return _all_pools[getattr(request, "param", "gloo")]


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
