"""Shared process pools: starting ranks is slow on 2 cores, so each world size starts once."""

from __future__ import annotations

from collections.abc import Iterator

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
