"""Bad input gets a clear error naming the argument, raised before anything moves, and leaves
the communicator usable; mismatched collectives across ranks are caught by debug checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from disttrain.comm import CollectiveMismatchError, CommConfig, Communicator


def _sibling(comm: Communicator, **config: Any) -> Communicator:
    """Another communicator on the pool's transport (every rank makes one, so tags agree);
    ``close()`` on it must leave the shared transport open."""
    config.setdefault("timeout_s", comm.config.timeout_s)
    return Communicator(comm.transport, CommConfig(**config), owns_transport=False)

# (name, call on communicator c at rank r, exception type, fragments of the message, where
# "{r}" stands for the rank)
Case = tuple[str, Callable[[Communicator, int], Any], type, list[str]]


def _cases() -> list[Case]:
    f32 = torch.ones(4)
    i64 = torch.ones(4, dtype=torch.int64)
    return [
        ("root out of range", lambda c, r: c.broadcast(f32, 5), ValueError,
         ["root=5", "0..3"]),
        ("negative root", lambda c, r: c.reduce(f32, -1), ValueError, ["root=-1", "0..3"]),
        ("float root", lambda c, r: c.broadcast(f32, 1.0), TypeError, ["root", "1.0"]),
        ("str root", lambda c, r: c.gather(None, f32, "0"), TypeError, ["root", "'0'"]),
        ("bool root", lambda c, r: c.scatter(f32, None, True), TypeError, ["root", "True"]),
        ("dst out of range", lambda c, r: c.send(f32, 4), ValueError, ["dst=4", "0..3"]),
        ("src out of range", lambda c, r: c.irecv(f32, -2), ValueError, ["src=-2", "0..3"]),
        ("send to self", lambda c, r: c.isend(f32, r), ValueError, ["dst={r}", "itself"]),
        ("recv from self", lambda c, r: c.recv(f32, r), ValueError, ["src={r}", "itself"]),
        ("not a tensor", lambda c, r: c.all_reduce([1.0, 2.0]), TypeError,
         ["tensor must be a torch.Tensor", "list"]),
        ("non-contiguous", lambda c, r: c.all_reduce(torch.ones(4, 6).t()), ValueError,
         ["tensor is not contiguous", ".contiguous()"]),
        ("non-contiguous output", lambda c, r: c.all_gather(torch.ones(8, 4).t(), f32),
         ValueError, ["output is not contiguous"]),
        ("wrong device", lambda c, r: c.all_reduce(torch.ones(4, device="meta")), ValueError,
         ["tensor is on meta", ".to('cpu')"]),
        ("all_gather output size", lambda c, r: c.all_gather(torch.ones(15), f32), ValueError,
         ["output must hold", "4 × 4 = 16", "has 15"]),
        ("reduce_scatter input size", lambda c, r: c.reduce_scatter(f32, torch.ones(17)),
         ValueError, ["tensor must hold", "= 16", "has 17"]),
        ("gather output size", lambda c, r: c.gather(torch.ones(3), f32, r), ValueError,
         ["output must hold", "has 3"]),
        ("gather output missing", lambda c, r: c.gather(None, f32, r), ValueError,
         ["output is required", "rank {r}"]),
        ("scatter input size", lambda c, r: c.scatter(f32, torch.ones(5), r), ValueError,
         ["tensor must hold", "has 5"]),
        ("scatter input missing", lambda c, r: c.scatter(f32, None, r), ValueError,
         ["tensor is required", "rank {r}"]),
        ("dtypes differ", lambda c, r: c.all_gather(torch.ones(16, dtype=torch.float64), f32),
         ValueError, ["output has dtype torch.float64", "tensor has torch.float32"]),
        ("reduce_scatter dtypes", lambda c, r: c.reduce_scatter(i64, torch.ones(16)),
         ValueError, ["output has dtype torch.int64"]),
        ("all_to_all splits sum", lambda c, r: c.all_to_all(torch.ones(8), torch.ones(8),
                                                             [2, 2, 2, 2], [1, 2, 3, 1]),
         ValueError, ["input_split_sizes sums to 7", "8 rows"]),
        ("all_to_all splits length", lambda c, r: c.all_to_all(torch.ones(8), torch.ones(8),
                                                                [4, 4], None),
         ValueError, ["output_split_sizes must be 4 non-negative ints"]),
        ("all_to_all uneven without splits", lambda c, r: c.all_to_all(torch.ones(6),
                                                                        torch.ones(6)),
         ValueError, ["6 rows", "input_split_sizes"]),
        ("all_to_all row shapes", lambda c, r: c.all_to_all(torch.ones(4, 2), torch.ones(4, 3)),
         ValueError, ["output rows have shape (2,)", "(3,)"]),
        ("algorithm not for op", lambda c, r: c.all_gather(torch.ones(16), f32,
                                                           algorithm="tree"),
         ValueError, ["algorithm='tree' is not available for all_gather",
                      "auto, naive, ring, halving_doubling, native"]),
        ("unknown algorithm", lambda c, r: c.all_reduce(f32, algorithm="rnig"), ValueError,
         ["algorithm='rnig'", "ring"]),
        ("unknown reduce op", lambda c, r: c.all_reduce(f32, "mean"), ValueError,
         ["op='mean'", "sum, prod, min, max, avg"]),
        ("avg on integers", lambda c, r: c.all_reduce(i64, "avg"), ValueError,
         ["op='avg'", "torch.int64"]),
        ("avg reduce_scatter ints", lambda c, r: c.reduce_scatter(
            torch.ones(1, dtype=torch.int64), i64, "avg"), ValueError, ["op='avg'"]),
        ("tag too big", lambda c, r: c.isend(f32, (r + 1) % 4, tag=1 << 24), ValueError,
         ["tag must be an int in 0..16777215", "16777216"]),
        ("negative tag", lambda c, r: c.irecv(f32, (r + 1) % 4, tag=-1), ValueError,
         ["tag must be an int", "-1"]),
        ("new_group duplicates", lambda c, r: c.new_group([0, 1, 1]), ValueError,
         ["duplicates", "[0, 1, 1]"]),
        ("new_group out of range", lambda c, r: c.new_group([0, 4]), ValueError,
         ["ranks[1]=4", "0..3"]),
        ("new_group empty", lambda c, r: c.new_group([]), ValueError, ["at least one rank"]),
    ]


def bad_inputs(comm: Communicator) -> dict[str, Any]:
    """Every rank makes every mistake (so no rank waits for another), then works normally."""
    c = _sibling(comm)
    seen: dict[str, Any] = {}
    for name, call, _, _ in _cases():
        try:
            call(c, comm.rank)
            seen[name] = None
        except Exception as exc:  # the test inspects it
            seen[name] = (type(exc).__name__, str(exc))
    nothing_moved = c.stats.snapshot() == {} and c.flight_recorder.dump() == []
    t = torch.full((5,), float(comm.rank))
    c.all_reduce(t)  # still usable, and its sequence number is the first one
    expected = float(sum(range(comm.world_size)))
    return {"errors": seen, "nothing_moved": nothing_moved,
            "usable": t.tolist() == [expected] * 5,
            "first_seq": c.flight_recorder.dump()[0]["seq"]}


def test_bad_input_raises_naming_the_argument_before_anything_moves(pools):
    results = pools(4).run(bad_inputs)
    for rank, res in enumerate(results):
        assert res["nothing_moved"], f"rank {rank}: bytes moved or a collective was recorded"
        assert res["usable"] and res["first_seq"] == 1, f"rank {rank}"
        for name, _, exc_type, fragments in _cases():
            got = res["errors"][name]
            assert got is not None, f"rank {rank}: {name} did not raise"
            kind, message = got
            assert kind == exc_type.__name__, f"rank {rank}: {name} raised {kind}: {message}"
            for fragment in (f.replace("{r}", str(rank)) for f in fragments):
                assert fragment in message, f"rank {rank}: {name}: {fragment!r} not in {message!r}"


# ----------------------------------------------------------------------------- debug checks


def mismatched_collectives(comm: Communicator) -> dict[str, Any]:
    """Each case has rank 2 (or rank 0) differ; every rank must raise, naming what and who."""
    c = _sibling(comm, debug_checks=True)
    r = comm.rank
    cases: dict[str, Callable[[], Any]] = {
        "numel": lambda: c.all_reduce(torch.ones(7 if r == 2 else 6)),
        "dtype": lambda: c.all_reduce(torch.ones(6, dtype=torch.float64 if r == 2
                                                 else torch.float32)),
        "operation": lambda: (c.broadcast(torch.ones(6), 0) if r == 0
                              else c.all_reduce(torch.ones(6))),
        "root": lambda: c.broadcast(torch.ones(6), 1 if r == 2 else 0),
        "reduce_op": lambda: c.all_reduce(torch.ones(6), "max" if r == 2 else "sum"),
        "async numel": lambda: c.all_gather(torch.empty(3 * (5 if r == 2 else 4)),
                                            torch.ones(5 if r == 2 else 4),
                                            async_op=True).wait(),  # type: ignore[union-attr]
        "barrier": lambda: c.barrier() if r == 2 else c.all_reduce(torch.ones(6)),
    }
    out: dict[str, Any] = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except CollectiveMismatchError as exc:
            out[name] = str(exc)
        t = torch.ones(3)  # after each mismatch the communicator still works, checks on
        c.all_reduce(t)
        out[name + " then"] = t.tolist()
    # legal uneven all_to_all: per-rank sizes differ, which debug checks must accept
    rows = torch.arange(r + 1, dtype=torch.float32) + 10 * r
    got = torch.full((sum(_a2a_splits(k)[r] for k in range(3)),), -1.0)
    c.all_to_all(got, rows, [_a2a_splits(k)[r] for k in range(3)], _a2a_splits(r))
    out["uneven all_to_all"] = got.tolist()
    c.close()
    return out


def _a2a_splits(k: int) -> list[int]:
    """Rank k (k + 1 rows) sends its first k rows to rank 0 and its last row to itself."""
    splits = [k, 0, 0]
    splits[k] += 1
    return splits


_EXPECT = {"numel": ("element count", "rank 2: all_reduce #1, 7 elements of float32"),
           "dtype": ("dtype", "rank 2: all_reduce #3, 6 elements of float64"),
           "operation": ("operation", "rank 0: broadcast #5"),
           "root": ("root", "root=1"),
           "reduce_op": ("reduce op", "op=max"),
           "async numel": ("element count", "all_gather #11"),
           "barrier": ("operation", "rank 2: barrier #13")}


def test_debug_checks_name_the_ranks_and_the_differing_field(pools):
    results = pools(3).run(mismatched_collectives)
    for rank, out in enumerate(results):
        for name, (field, detail) in _EXPECT.items():
            message = out[name]
            assert message is not None, f"rank {rank}: {name} mismatch not detected"
            assert "collective mismatch" in message and field in message, message
            assert detail in message, f"rank {rank}: {detail!r} not in {message!r}"
            assert out[name + " then"] == [3.0, 3.0, 3.0], f"rank {rank} unusable after {name}"
        assert out["uneven all_to_all"] == [[0.0, 10.0, 20.0, 21.0], [11.0], [22.0]][rank]
