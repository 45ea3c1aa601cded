"""The collective matrix on the shared-memory transport: algorithm ``shm`` and every P2P one.

Each pool rank builds one Communicator over a :class:`SharedMemoryTransport` (cached per
process) and runs ``collective_cases.check_collective`` on it, so results are checked
against a local single-process reference and against torch.distributed's own collective.
Slots are small here (256 KiB) so the 1 MiB cases stream through several rounds.
"""

from __future__ import annotations

import pytest
import torch

from disttrain.comm import ALGORITHMS, COLLECTIVES, CommConfig, Communicator
from disttrain.comm.transports import SharedMemoryTransport, ShmConfig
from tests import collective_cases

WORLD_SIZES = [1, 2, 3, 4]
SMALL = ShmConfig(slot_bytes=256 << 10, mailbox_slots=3, mailbox_slot_bytes=64 << 10,
                  one_shot_max_bytes=16 << 10)
_comm: Communicator | None = None


def shm_comm() -> Communicator:
    """This process's communicator over shared memory (created collectively on first use)."""
    global _comm
    if _comm is None:
        _comm = Communicator(SharedMemoryTransport(config=SMALL), CommConfig(timeout_s=20))
    return _comm


def run_cases(_torch_comm: Communicator, op: str, *args: object) -> list[str]:
    return collective_cases.check_collective(shm_comm(), op, *args)  # type: ignore[arg-type]


def _errors(per_rank: list[list[str]]) -> str:
    return "\n".join([e for rank_errors in per_rank for e in rank_errors][:20])


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op", COLLECTIVES)
def test_shm_algorithm_matches_torch(pools, op, world_size):
    """Every dtype and size (0, 1, 13, 1001, > 1 MiB) with algorithm='shm'."""
    per_rank = pools(world_size).run(run_cases, op, None, "sum", None, ["shm"])
    assert not _errors(per_rank), _errors(per_rank)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("op", COLLECTIVES)
def test_every_p2p_algorithm_runs_on_shm(pools, op, world_size):
    """The message-passing algorithms (and native, on the rendezvous group) over shm P2P."""
    others = [a for a in ALGORITHMS[op] if a != "shm"]
    per_rank = pools(world_size).run(run_cases, op, ["float32", "int64"], "sum",
                                     [0, 13, 1001, (1 << 20) // 8 + 5], others)
    assert not _errors(per_rank), _errors(per_rank)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("reduce_op", ["prod", "min", "max", "avg"])
@pytest.mark.parametrize("op", ["all_reduce", "reduce", "reduce_scatter"])
def test_shm_reduce_ops(pools, op, reduce_op, world_size):
    per_rank = pools(world_size).run(run_cases, op, ["float32", "int64", "bfloat16"],
                                     reduce_op, [1, 13, 1001, 70_001], ["shm"])
    assert not _errors(per_rank), _errors(per_rank)


def repeated_all_reduce(_torch_comm: Communicator, iterations: int) -> list[float]:
    """Many back-to-back collectives of mixed shapes: buffer sets alternate correctly."""
    comm, p, r = shm_comm(), shm_comm().world_size, shm_comm().rank
    firsts = []
    for i in range(iterations):
        n = (1, 300, 5000, 100_000)[i % 4]  # one-shot and streamed rounds interleaved
        x = torch.full((n,), float(r + i))
        comm.all_reduce(x, algorithm="shm")
        expected = float(sum(k + i for k in range(p)))
        assert bool((x == expected).all()), f"iteration {i}: {x[:3]} != {expected}"
        comm.barrier(algorithm="shm")
        firsts.append(float(x[0]))
    return firsts


def test_four_ranks_on_two_cores_make_progress(pools):
    """More ranks than cores: waits yield, so every collective completes (within the
    per-wait timeout) with the right value."""
    per_rank = pools(4).run(repeated_all_reduce, 120)
    assert all(values == per_rank[0] for values in per_rank)


def mismatched_all_to_all(_torch_comm: Communicator) -> str:
    comm = shm_comm()
    p, r = comm.world_size, comm.rank
    splits = [1] * p
    out_splits = [2 if (r == 0 and j == 1) else 1 for j in range(p)]  # rank 0 lies
    try:
        comm.all_to_all(torch.zeros(sum(out_splits)), torch.zeros(p), out_splits, splits,
                        algorithm="shm")
    except ValueError as exc:
        message = str(exc)
    else:
        message = "no error"
    x = torch.ones(4)  # the communicator is still usable afterwards
    comm.all_reduce(x, algorithm="shm")
    assert bool((x == p).all())
    return message


def test_all_to_all_split_mismatch_is_reported_on_every_rank(pools):
    messages = pools(3).run(mismatched_all_to_all)
    for message in messages:
        assert "rank 1 sends 1 elements to rank 0, which expects 2" in message


def count_bytes(_torch_comm: Communicator, n: int) -> dict[str, int]:
    comm = shm_comm()
    comm.stats.reset()
    comm.all_reduce(torch.ones(n), algorithm="shm")
    return comm.stats.snapshot()["all_reduce"]


def test_shm_counts_bytes_through_the_segment(pools):
    """One-shot: each rank writes its n·4 bytes and reads the p−1 other slots."""
    per_rank = pools(3).run(count_bytes, 1000)
    for entry in per_rank:
        assert entry["bytes_sent"] == 4000 and entry["bytes_recv"] == 2 * 4000


def counted_and_theory(_torch_comm: Communicator, n: int) -> dict[str, tuple[int, float]]:
    """Every collective once with algorithm 'shm' on n·p float32 elements: the bytes this
    rank counted as sent, and Communicator.theory_bytes_sent (the busiest rank's)."""
    comm = shm_comm()
    p, me = comm.world_size, comm.rank
    v = n * p
    calls = {
        "all_reduce": (v, lambda: comm.all_reduce(torch.ones(v), algorithm="shm")),
        "reduce_scatter": (v, lambda: comm.reduce_scatter(torch.empty(n), torch.ones(v),
                                                          algorithm="shm")),
        "all_gather": (v, lambda: comm.all_gather(torch.empty(v), torch.ones(n),
                                                  algorithm="shm")),
        "broadcast": (v, lambda: comm.broadcast(torch.ones(v), 0, algorithm="shm")),
        "reduce": (v, lambda: comm.reduce(torch.ones(v), 0, algorithm="shm")),
        "gather": (v, lambda: comm.gather(torch.empty(v) if me == 0 else None, torch.ones(n),
                                          0, algorithm="shm")),
        "scatter": (v, lambda: comm.scatter(torch.empty(n), torch.ones(v) if me == 0 else None,
                                            0, algorithm="shm")),
        "all_to_all": (v, lambda: comm.all_to_all(torch.empty(v), torch.ones(v),
                                                  algorithm="shm")),
    }
    out = {}
    for op, (elements, call) in calls.items():
        comm.stats.reset()
        call()
        out[op] = (comm.stats.snapshot()[op]["bytes_sent"],
                   comm.theory_bytes_sent(op, 4 * elements, "shm"))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("n", [1000, 300_000])  # one round (one-shot), several rounds
def test_shm_bytes_sent_equal_their_theory(pools, world_size, n):
    """What shm 'sends' is what a rank writes into shared memory for the others; the
    busiest rank's count equals comm/theory.py's figure for every collective."""
    per_rank = pools(world_size).run(counted_and_theory, n)
    for op in per_rank[0]:
        busiest = max(counts[op][0] for counts in per_rank)
        assert busiest == per_rank[0][op][1], (op, [c[op] for c in per_rank])
