"""One benchmark case on one rank: buffers, the call, and an exact check of its result.

Inputs are small integers stored as float32, different on every rank and rebuilt from the
rank number alone, so each rank computes every reference locally and sums are exact in any
order: a result is either bit-for-bit right or wrong (no tolerance to tune). Roots are rank
0. ``reset`` restores the inputs and poisons the outputs before each call, so an algorithm
that does nothing cannot pass the check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from disttrain.comm import Communicator

ELEMENT = torch.float32
ELEMENT_SIZE = 4
BLOCKED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")  # p blocks
_POISON = float("nan")


@dataclass
class Case:
    """What the timing loop needs: ``run(algorithm)`` one call, ``reset()`` and ``check()``."""

    op: str
    nbytes: int  # the nccl-tests size actually used (whole buffer; see elements())
    run: Callable[[str], None]
    reset: Callable[[], None]
    check: Callable[[], bool]


def elements(op: str, nbytes: int, p: int) -> int:
    """float32 elements of the whole buffer for ``nbytes``, a multiple of p for blocked ops."""
    n = max(1, nbytes // ELEMENT_SIZE)
    if op in BLOCKED:
        n = max(p, n - n % p)
    return n


def values(rank: int, n: int, offset: int = 0) -> torch.Tensor:
    """Rank ``rank``'s deterministic input: integers in [−15, 15], exact in float32 sums."""
    i = torch.arange(offset, offset + n, dtype=torch.int64)
    return ((i * 7 + rank * 13) % 31 - 15).to(ELEMENT)


def _sum_over_ranks(n: int, p: int) -> torch.Tensor:
    total = values(0, n)
    for r in range(1, p):
        total += values(r, n)
    return total


def build(comm: Communicator, op: str, nbytes: int, shared: bool = False) -> Case:
    """The case for collective ``op`` at about ``nbytes`` (see :func:`elements`). ``shared``:
    the in-place ops (all_reduce, broadcast, reduce) work on a tensor from
    ``Communicator.shared_zeros`` (on ``shm``, all_reduce then skips its copy in: the
    counterpart of nccl-tests' ``-R`` registered buffers)."""
    if op not in _BUILDERS:
        raise ValueError(f"no benchmark case for {op!r}; known: {', '.join(_BUILDERS)}")
    n = elements(op, nbytes, comm.world_size)
    buf = comm.shared_zeros(n, ELEMENT) if shared else torch.zeros(n, dtype=ELEMENT)
    run, reset, check = _BUILDERS[op](comm, n, buf)
    return Case(op, n * ELEMENT_SIZE, run, reset, check)


_Parts = tuple[Callable[[str], None], Callable[[], None], Callable[[], bool]]


def _in_place(comm: Communicator, buf: torch.Tensor,
              call: Callable[[torch.Tensor, str], object], expected: torch.Tensor) -> _Parts:
    pristine = values(comm.rank, buf.numel())
    buf.copy_(pristine)

    def run(algorithm: str) -> None:
        call(buf, algorithm)

    def reset() -> None:
        buf.copy_(pristine)

    return run, reset, lambda: torch.equal(buf, expected)


def _all_reduce(comm: Communicator, n: int, buf: torch.Tensor) -> _Parts:
    return _in_place(comm, buf, lambda t, a: comm.all_reduce(t, algorithm=a),
                     _sum_over_ranks(n, comm.world_size))


def _broadcast(comm: Communicator, n: int, buf: torch.Tensor) -> _Parts:
    return _in_place(comm, buf, lambda t, a: comm.broadcast(t, 0, algorithm=a), values(0, n))


def _reduce(comm: Communicator, n: int, buf: torch.Tensor) -> _Parts:
    expected = _sum_over_ranks(n, comm.world_size) if comm.rank == 0 else values(comm.rank, n)
    return _in_place(comm, buf, lambda t, a: comm.reduce(t, 0, algorithm=a), expected)


def _out_of_place(out: torch.Tensor, call: Callable[[str], object],
                  expected: torch.Tensor) -> _Parts:
    def run(algorithm: str) -> None:
        call(algorithm)

    def reset() -> None:
        out.fill_(_POISON)

    return run, reset, lambda: torch.equal(out, expected)


def _all_gather(comm: Communicator, n: int, _buf: torch.Tensor) -> _Parts:
    p, b = comm.world_size, n // comm.world_size
    mine, out = values(comm.rank, b), torch.empty(n, dtype=ELEMENT)
    expected = torch.cat([values(r, b) for r in range(p)])
    return _out_of_place(out, lambda a: comm.all_gather(out, mine, algorithm=a), expected)


def _reduce_scatter(comm: Communicator, n: int, _buf: torch.Tensor) -> _Parts:
    p, r, b = comm.world_size, comm.rank, n // comm.world_size
    mine, out = values(r, n), torch.empty(b, dtype=ELEMENT)
    expected = _sum_over_ranks(n, p)[r * b : (r + 1) * b].clone()
    return _out_of_place(out, lambda a: comm.reduce_scatter(out, mine, algorithm=a), expected)


def _all_to_all(comm: Communicator, n: int, _buf: torch.Tensor) -> _Parts:
    p, r, b = comm.world_size, comm.rank, n // comm.world_size
    mine, out = values(r, n), torch.empty(n, dtype=ELEMENT)
    expected = torch.cat([values(j, b, offset=r * b) for j in range(p)])
    return _out_of_place(out, lambda a: comm.all_to_all(out, mine, algorithm=a), expected)


def _gather(comm: Communicator, n: int, _buf: torch.Tensor) -> _Parts:
    p, r, b = comm.world_size, comm.rank, n // comm.world_size
    mine = values(r, b)
    out = torch.empty(n if r == 0 else 0, dtype=ELEMENT)
    expected = torch.cat([values(j, b) for j in range(p)]) if r == 0 else out.clone()
    return _out_of_place(out, lambda a: comm.gather(out if r == 0 else None, mine, 0,
                                                    algorithm=a), expected)


def _scatter(comm: Communicator, n: int, _buf: torch.Tensor) -> _Parts:
    r, b = comm.rank, n // comm.world_size
    source = values(0, n) if r == 0 else None
    out = torch.empty(b, dtype=ELEMENT)
    expected = values(0, b, offset=r * b)
    return _out_of_place(out, lambda a: comm.scatter(out, source, 0, algorithm=a), expected)


# builder(comm, n, buf): buf is n zeros the in-place ops use (out-of-place ones ignore it)
_BUILDERS: dict[str, Callable[[Communicator, int, torch.Tensor], _Parts]] = {
    "all_reduce": _all_reduce,
    "broadcast": _broadcast,
    "reduce": _reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
    "gather": _gather,
    "scatter": _scatter,
}

BENCHMARKED_OPS = tuple(_BUILDERS)
