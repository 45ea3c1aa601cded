"""Inputs and single-process references for the collective test matrix (runs inside ranks).

Every rank can rebuild every other rank's input from the seed, so each case is checked
twice: against a reference computed locally from all inputs (exact for integers), and
against torch.distributed's own collective on the same inputs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disttrain.comm import ALGORITHMS, Communicator
from disttrain.comm.transports.shm import collectives as shm_algorithms

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]
TORCH_OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
             "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.SUM}


def sizes(dtype: torch.dtype, world_size: int) -> list[int]:
    """0, 1, a prime, a size not divisible by the world size, and ≥ 1 MiB."""
    big = (1 << 20) // torch.tensor([], dtype=dtype).element_size() + 7
    return [0, 1, 13, 1001, big]


def make(rank: int, n: int, dtype: torch.dtype, case: int, op: str = "sum") -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + rank)
    if op == "prod":  # stay small so products are exact in every dtype
        values = torch.tensor([1.0, 2.0, -1.0, 0.5])[torch.randint(0, 4, (n,), generator=gen)]
        if not dtype.is_floating_point:
            values = torch.tensor([1, 2, -1, -2])[torch.randint(0, 4, (n,), generator=gen)]
        return values.to(dtype)
    if dtype in (torch.float32, torch.float64):
        return torch.randn(n, generator=gen, dtype=dtype)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)  # exact in bf16 and ints


def reduce_local(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = parts[0].clone()
    for part in parts[1:]:
        if op in ("sum", "avg"):
            acc += part
        elif op == "prod":
            acc *= part
        elif op == "min":
            acc = torch.minimum(acc, part)
        else:
            acc = torch.maximum(acc, part)
    if op == "avg":
        acc = acc / len(parts)
    return acc


def close(actual: torch.Tensor, expected: torch.Tensor, what: str, errors: list[str]) -> None:
    try:
        if actual.dtype.is_floating_point and actual.dtype != torch.bfloat16:
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    except AssertionError as exc:
        errors.append(f"{what}: {str(exc).splitlines()[0:3]}")


def check_collective(comm: Communicator, op: str, dtypes: list[str] | None = None,
                     reduce_op: str = "sum", size_list: list[int] | None = None,
                     algorithms: list[str] | None = None) -> list[str]:
    """Run ``op`` with every algorithm, dtype and size; return the mismatches found."""
    p, r = comm.world_size, comm.rank
    errors: list[str] = []
    chosen = [getattr(torch, d) for d in dtypes] if dtypes else DTYPES
    case = 0
    for dtype in chosen:
        if reduce_op == "avg" and not dtype.is_floating_point:
            continue
        for n in size_list or sizes(dtype, p):
            case += 1
            inputs = [make(k, n if op not in _BLOCKED else n * p, dtype, case, reduce_op)
                      for k in range(p)]
            for algorithm in algorithms or runnable(comm, op):
                what = f"{op}/{algorithm} p={p} rank={r} {dtype} n={n} op={reduce_op}"
                try:
                    _RUNNERS[op](comm, inputs, algorithm, reduce_op, what, errors)
                except Exception as exc:
                    errors.append(f"{what}: raised {type(exc).__name__}: {exc}")
    return errors


_BLOCKED = {"reduce_scatter", "scatter", "all_to_all"}  # inputs are p blocks


def runnable(comm: Communicator, op: str) -> list[str]:
    """Every registered algorithm for ``op`` that this communicator's transport can run."""
    return [a for a in ALGORITHMS[op] if a != "shm" or shm_algorithms.supports(comm.transport)]


def _all_reduce(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
                what: str, errors: list[str]) -> None:
    t = inputs[comm.rank].clone()
    comm.all_reduce(t, rop, algorithm=algo)
    ref = inputs[comm.rank].clone()
    dist.all_reduce(ref, TORCH_OPS[rop])
    if rop == "avg":
        ref = ref / comm.world_size
    close(t, reduce_local(inputs, rop), what + " vs local", errors)
    close(t, ref, what + " vs torch", errors)


def _broadcast(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
               what: str, errors: list[str]) -> None:
    root = comm.world_size - 1
    t = inputs[comm.rank].clone()
    comm.broadcast(t, root, algorithm=algo)
    ref = inputs[comm.rank].clone()
    dist.broadcast(ref, root)
    close(t, inputs[root], what + " vs local", errors)
    close(t, ref, what + " vs torch", errors)


def _reduce(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
            what: str, errors: list[str]) -> None:
    root = 1 % comm.world_size
    t = inputs[comm.rank].clone()
    comm.reduce(t, root, rop, algorithm=algo)
    if comm.rank == root:
        close(t, reduce_local(inputs, rop), what + " vs local", errors)
    else:
        close(t, inputs[comm.rank], what + " non-root untouched", errors)


def _gather(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
            what: str, errors: list[str]) -> None:
    root = comm.world_size // 2
    n = inputs[0].numel()
    out = None
    if comm.rank == root:
        out = torch.full((comm.world_size * n,), 99, dtype=inputs[0].dtype)
    comm.gather(out, inputs[comm.rank], root, algorithm=algo)
    if out is not None:
        close(out, torch.cat(inputs), what + " vs local", errors)


def _scatter(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
             what: str, errors: list[str]) -> None:
    root = comm.world_size - 1
    p, n = comm.world_size, inputs[0].numel() // comm.world_size
    out = torch.full((n,), 99, dtype=inputs[0].dtype)
    comm.scatter(out, inputs[root] if comm.rank == root else None, root, algorithm=algo)
    close(out, inputs[root][comm.rank * n : (comm.rank + 1) * n], what + " vs local", errors)
    ref = torch.empty_like(out)
    dist.scatter(ref, list(inputs[root].chunk(p)) if comm.rank == root and n else
                 ([torch.empty(0, dtype=out.dtype)] * p if comm.rank == root else None), root)
    close(out, ref, what + " vs torch", errors)


def _all_gather(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
                what: str, errors: list[str]) -> None:
    n = inputs[0].numel()
    out = torch.full((comm.world_size * n,), 99, dtype=inputs[0].dtype)
    comm.all_gather(out, inputs[comm.rank], algorithm=algo)
    ref = torch.empty_like(out)
    dist.all_gather_into_tensor(ref, inputs[comm.rank])
    close(out, torch.cat(inputs), what + " vs local", errors)
    close(out, ref, what + " vs torch", errors)


def _reduce_scatter(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
                    what: str, errors: list[str]) -> None:
    p, r = comm.world_size, comm.rank
    n = inputs[0].numel() // p
    out = torch.full((n,), 99, dtype=inputs[0].dtype)
    before = inputs[r].clone()
    comm.reduce_scatter(out, inputs[r], rop, algorithm=algo)
    close(out, reduce_local(inputs, rop)[r * n : (r + 1) * n], what + " vs local", errors)
    close(inputs[r], before, what + " input untouched", errors)
    if rop != "avg":
        ref = torch.empty_like(out)
        dist.reduce_scatter_tensor(ref, inputs[r].clone(), TORCH_OPS[rop])
        close(out, ref, what + " vs torch", errors)


def _all_to_all(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
                what: str, errors: list[str]) -> None:
    p, r = comm.world_size, comm.rank
    total = inputs[0].numel()
    # uneven splits: rank k sends (j + k + total) % 3 + base rows to rank j, all ranks agree
    base = total // p

    def split(k: int, j: int) -> int:
        return base + (j + k) % 3 if base else (j + k) % 2

    ins = [torch.cat([make(k, split(k, j), inputs[0].dtype, 7 + 31 * j) for j in range(p)])
           for k in range(p)]
    in_splits = [split(r, j) for j in range(p)]
    out_splits = [split(j, r) for j in range(p)]
    out = torch.full((sum(out_splits),), 99, dtype=inputs[0].dtype)
    comm.all_to_all(out, ins[r], out_splits, in_splits, algorithm=algo)
    expected = []
    for j in range(p):
        offset = sum(split(j, i) for i in range(r))
        expected.append(ins[j][offset : offset + split(j, r)])
    close(out, torch.cat(expected), what + " uneven vs local", errors)
    ref = torch.empty_like(out)
    dist.all_to_all_single(ref, ins[r], out_splits, in_splits)
    close(out, ref, what + " uneven vs torch", errors)
    if total % p == 0:  # equal splits, 2-D rows
        rows = inputs[r].view(p, -1)
        out2 = torch.empty_like(rows)
        comm.all_to_all(out2, rows, algorithm=algo)
        exp2 = torch.stack([inputs[k].view(p, -1)[r] for k in range(p)])
        close(out2, exp2, what + " equal vs local", errors)


def _barrier(comm: Communicator, inputs: list[torch.Tensor], algo: str, rop: str,
             what: str, errors: list[str]) -> None:
    comm.barrier(algorithm=algo)


_RUNNERS: dict[str, Any] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce, "gather": _gather,
    "scatter": _scatter, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all, "barrier": _barrier,
}
