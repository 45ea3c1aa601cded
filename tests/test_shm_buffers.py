"""Shared buffers (``Communicator.shared_zeros``): all-reduce where the tensors lie.

The in-place path must give the same bits as the copy path through the slots (itself
checked against torch.distributed in test_shm_collectives.py) and as a single-process
reduction in rank order; ranks that disagree on the kind of tensor get an error on every
rank, and the communicator stays usable; no segment name is left in /dev/shm.
"""

from __future__ import annotations

import os

import pytest
import torch

from disttrain.comm import Communicator
from disttrain.comm.ops import ReduceOp
from disttrain.comm.transports import SharedMemoryTransport
from tests.test_shm_collectives import shm_comm

KERNEL = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum,
          "max": torch.maximum}


def inputs(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g)
        if op == "prod":  # keep products finite and away from 0
            x = 1.0 + 0.1 * x
        x[::97] = -0.0 if rank % 2 else 0.0  # signed zeros: min/max must keep rank order
        return x.to(dtype)
    return torch.randint(-50, 50, (n,), generator=g, dtype=dtype)


def reference(p: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """One process: ((x0 ⊕ x1) ⊕ x2) …, then ÷ p for avg."""
    acc = inputs(0, n, dtype, op).clone()
    for r in range(1, p):
        acc = KERNEL[op](acc, inputs(r, n, dtype, op))
    return acc / p if op == "avg" else acc


CASES = [(op, dtype, n) for op in ("sum", "avg", "prod", "min", "max")
         for dtype in (torch.float32, torch.bfloat16, torch.int64)
         for n in (5000, 70_001)  # both above the 16 KiB one-shot limit; 70 001 is odd
         if not (op == "avg" and not dtype.is_floating_point)]


def check_in_place(_torch_comm: Communicator) -> list[str]:
    comm = shm_comm()
    p, me, errors = comm.world_size, comm.rank, []
    buffers = {dtype: comm.shared_zeros(max(n for _, _, n in CASES) + 3, dtype)
               for dtype in (torch.float32, torch.bfloat16, torch.int64)}
    for op, dtype, n in CASES:
        buffer = buffers[dtype]
        shared = buffer[3 : 3 + n]  # a slice at an offset: the same slice on every rank
        shared.copy_(inputs(me, n, dtype, op))
        plain = inputs(me, n, dtype, op)
        comm.all_reduce(shared, op, algorithm="shm")
        comm.all_reduce(plain, op, algorithm="shm")  # the copy path through the slots
        name = f"{op} {dtype} n={n}"
        if not torch.equal(shared, plain):
            errors.append(f"{name}: in place differs from the slot path")
        torch.testing.assert_close(shared, reference(p, n, dtype, op), msg=name)
        if not torch.equal(buffer[:3], torch.zeros(3, dtype=dtype)):
            errors.append(f"{name}: elements outside the slice changed")
    return errors


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_in_place_all_reduce_equals_slot_path_and_reference(pools, world_size):
    per_rank = pools(world_size).run(check_in_place)
    assert per_rank == [[]] * world_size


def mismatch(_torch_comm: Communicator) -> tuple[str, bool]:
    comm = shm_comm()
    n = 20_000
    shared = comm.shared_zeros(n)
    x = torch.ones(n) if comm.rank == 0 else shared.fill_(1.0)  # rank 0 passes a plain one
    try:
        comm.all_reduce(x, algorithm="shm")
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    shared.fill_(2.0)  # still usable: every rank now passes the shared tensor
    comm.all_reduce(shared, algorithm="shm")
    return message, bool((shared == 2.0 * comm.world_size).all())


def op_mismatch(_torch_comm: Communicator) -> str:
    comm = shm_comm()
    x = torch.ones(20_000)
    try:
        comm.all_reduce(x, "max" if comm.rank == 1 else "sum", algorithm="shm")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_ranks_disagreeing_on_the_op_fail_on_every_rank(pools):
    """The declaration covers the slot path too: a rank reducing with another op (or
    dtype, or size) would silently mix results."""
    for message in pools(2).run(op_mismatch):
        assert "rank 0: an ordinary tensor, 80000 bytes of float32, sum" in message
        assert "rank 1: an ordinary tensor, 80000 bytes of float32, max" in message


def test_ranks_disagreeing_on_the_tensor_fail_on_every_rank(pools):
    per_rank = pools(3).run(mismatch)
    for message, usable in per_rank:
        assert "rank 0: an ordinary tensor, 80000 bytes of float32, sum" in message
        assert "rank 1: shared buffer #" in message and "Communicator.shared_zeros" in message
        assert usable


def segments_and_bad_args(_torch_comm: Communicator) -> dict[str, object]:
    comm = shm_comm()
    transport = comm.transport
    assert isinstance(transport, SharedMemoryTransport)
    x = comm.shared_zeros((3, 5), torch.float64)
    names = transport.buffers.names
    errors = []
    for bad in (-1, (2, -3), 2.5, True):
        try:
            comm.shared_zeros(bad)  # type: ignore[arg-type]
        except ValueError as exc:
            errors.append(str(exc))
    plain = Communicator.from_torch().shared_zeros(4, torch.int32)  # torch transport
    # only_if_useful: a size the one-shot path copies anyway stays ordinary; above it, shared
    small = comm.shared_zeros(16, only_if_useful=True)
    big = comm.shared_zeros((2, 1 << 16), only_if_useful=True)  # 512 KiB > 256 KiB
    return {"shape": tuple(x.shape), "dtype": str(x.dtype), "zeros": bool((x == 0).all()),
            "left": [n for n in names if os.path.exists(f"/dev/shm/{n}")],
            "errors": errors, "plain": (tuple(plain.shape), str(plain.dtype)),
            "useful": (transport.buffers.find(small) is not None,
                       transport.buffers.find(big) is not None, tuple(big.shape))}


def test_shared_zeros_allocates_leaves_no_name_and_checks_its_arguments(pools):
    for out in pools(2).run(segments_and_bad_args):
        assert out["shape"] == (3, 5) and out["dtype"] == "torch.float64" and out["zeros"]
        assert out["left"] == []
        assert len(out["errors"]) == 4 and all("shape must be" in e for e in out["errors"])
        assert out["plain"] == ((4,), "torch.int32")
        assert out["useful"] == (False, True, (2, 1 << 16))


def test_reduce_ops_all_have_kernels():
    """The in-place path needs a kernel for every op the communicator accepts."""
    from disttrain.comm.transports.shm.collectives import KERNELS
    assert set(KERNELS) == set(ReduceOp)
