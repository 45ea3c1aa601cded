"""The algorithm registry: ``ALGORITHMS[op][name]`` is a plain function ``fn(ctx, ...)``.

Signatures, by collective (``ctx`` is a :class:`~disttrain.comm.context.CollectiveContext`;
tensors are flat and contiguous, validated by the Communicator before the call):

=============== ===============================================================
all_reduce      ``fn(ctx, tensor, op)``                 in place
broadcast       ``fn(ctx, tensor, root)``               in place
reduce          ``fn(ctx, tensor, root, op)``           result on root; others scratch
gather          ``fn(ctx, output | None, tensor, root)``  output = p blocks, on root
scatter         ``fn(ctx, output, tensor | None, root)``  tensor = p blocks, on root
all_gather      ``fn(ctx, output, tensor)``             output = p blocks
reduce_scatter  ``fn(ctx, output, tensor, op)``          tensor = p blocks
all_to_all      ``fn(ctx, output, tensor, out_splits, in_splits)``
barrier         ``fn(ctx)``
=============== ===============================================================

Adding an algorithm is one entry here; ``auto`` picks among the entries by the cost model.
The ``shm`` entries live with the shared-memory transport they run on
(``disttrain/comm/transports/shm/``).
"""

from __future__ import annotations

from collections.abc import Callable

from disttrain.comm.algorithms import halving_doubling, hierarchical, naive, native, ring, tree
from disttrain.comm.transports.shm import collectives as shm
from disttrain.comm.transports.shm.all_reduce import all_reduce as shm_all_reduce

Algorithm = Callable[..., None]

ALGORITHMS: dict[str, dict[str, Algorithm]] = {
    "all_reduce": {
        "naive": naive.all_reduce,
        "ring": ring.all_reduce,
        "tree": tree.all_reduce,
        "halving_doubling": halving_doubling.all_reduce,
        "native": native.all_reduce,
        "shm": shm_all_reduce,
    },
    "broadcast": {"naive": naive.broadcast, "tree": tree.broadcast, "native": native.broadcast,
                  "shm": shm.broadcast},
    "reduce": {"naive": naive.reduce, "tree": tree.reduce, "native": native.reduce,
               "shm": shm.reduce},
    "gather": {"naive": naive.gather, "tree": tree.gather, "native": native.gather,
               "shm": shm.gather},
    "scatter": {"naive": naive.scatter, "tree": tree.scatter, "native": native.scatter,
                "shm": shm.scatter},
    "all_gather": {
        "naive": naive.all_gather,
        "ring": ring.all_gather,
        "halving_doubling": halving_doubling.all_gather,
        "native": native.all_gather,
        "shm": shm.all_gather,
    },
    "reduce_scatter": {
        "naive": naive.reduce_scatter,
        "ring": ring.reduce_scatter,
        "halving_doubling": halving_doubling.reduce_scatter,
        "native": native.reduce_scatter,
        "shm": shm.reduce_scatter,
    },
    "all_to_all": {"naive": naive.all_to_all, "native": native.all_to_all,
                   "shm": shm.all_to_all},
    "barrier": {"naive": naive.barrier, "tree": tree.barrier, "native": native.barrier,
                "shm": shm.barrier},
}
hierarchical.register(ALGORITHMS)  # all_reduce, broadcast, all_gather: docs/hierarchical.md

COLLECTIVES = tuple(ALGORITHMS)


def _neighbours(rank: int, size: int) -> set[int]:
    return {(rank - 1) % size, (rank + 1) % size}


def _everyone(rank: int, size: int) -> set[int]:
    return set(range(size))


# Where a pair's connection is created at its first message and that call blocks until the
# peer's first message (NCCL without a bound device), first contacts must not form a cycle.
# A ring's do (every rank first receives from its left neighbour), and so do naive
# all-to-all's staggered partners: the Communicator connects these peers first, in the
# order every rank shares (Transport.connect). The others' first contacts are acyclic (a
# tree's from the root down; exchanges lower rank first, in ascending order), which the
# NCCL-rules tests check at p = 2, 3, 4.
CONNECT_FIRST: dict[str, Callable[[int, int], set[int]]] = {
    "ring": _neighbours, "naive": _everyone}


def peers_to_connect(name: str, rank: int, size: int) -> set[int]:
    """The peers algorithm ``name`` connects to before its first message (see above)."""
    first = CONNECT_FIRST.get(name)
    return first(rank, size) - {rank} if first is not None and size > 1 else set()


def get(op: str, name: str) -> Algorithm:
    """The algorithm ``name`` for collective ``op``, or a ValueError listing the choices."""
    table = ALGORITHMS.get(op)
    if table is None:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")
    fn = table.get(name)
    if fn is None:
        raise ValueError(
            f"algorithm={name!r} is not available for {op}; choose one of: "
            f"{', '.join(['auto', *table])}"
        )
    return fn


def names(op: str) -> list[str]:
    return list(ALGORITHMS[op])


__all__ = ["ALGORITHMS", "COLLECTIVES", "CONNECT_FIRST", "Algorithm", "get", "names",
           "peers_to_connect"]
