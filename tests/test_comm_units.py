"""Pure unit tests of disttrain.comm (no processes): chunking, reduce ops, the flight recorder,
traffic counters, configuration and argument checks."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from disttrain.comm import (
    CommConfig,
    CommError,
    Communicator,
    ReduceOp,
    TrafficStats,
    Transport,
    checks,
)
from disttrain.comm.algorithms import chunking
from disttrain.comm.checks import rank_arg, splits_arg
from disttrain.comm.flight_recorder import FlightRecorder
from disttrain.comm.ops import check_dtype, combine_, finish_, parse_op

# ----------------------------------------------------------------------------- chunking


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 13, 16, 100, 1001])
def test_segment_bounds_cover_in_order_with_sizes_within_one(n, parts):
    bounds = chunking.segment_bounds(n, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert end == start  # contiguous, no gap, no overlap
    sizes = [end - start for start, end in bounds]
    assert min(sizes) >= 0 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra elements go to the first parts
    assert sizes.count(n // parts + 1) == (n % parts if n % parts else 0)


def test_segment_bounds_rejects_non_positive_parts():
    with pytest.raises(ValueError, match="parts must be positive"):
        chunking.segment_bounds(10, 0)


@pytest.mark.parametrize("max_elems", [1, 2, 3, 7, 64, 1000])
@pytest.mark.parametrize("start,end", [(0, 0), (5, 5), (0, 1), (3, 10), (0, 1000), (17, 1001)])
def test_sub_chunks_tile_the_range(start, end, max_elems):
    pieces = chunking.sub_chunks(start, end, max_elems)
    assert len(pieces) == math.ceil((end - start) / max_elems)
    covered = [i for a, b in pieces for i in range(a, b)]
    assert covered == list(range(start, end))
    assert all(0 < b - a <= max_elems for a, b in pieces)


def test_sub_chunks_and_chunk_elems_reject_bad_sizes():
    with pytest.raises(ValueError, match="max_elems must be positive"):
        chunking.sub_chunks(0, 10, 0)
    assert chunking.chunk_elems(4096, 4) == 1024
    assert chunking.chunk_elems(3, 8) == 1  # never zero elements per message


@pytest.mark.parametrize("p", range(1, 34))
def test_fold_map_and_virtual_rank_agree(p):
    q, members = chunking.fold_map(p)
    assert q == chunking.power_of_two_floor(p)
    assert q <= p < 2 * q and q & (q - 1) == 0
    assert len(members) == q
    assert [r for group in members for r in group] == list(range(p))  # a partition, in order
    assert all(len(group) in (1, 2) for group in members)
    assert sum(len(group) == 2 for group in members) == p - q
    for v, group in enumerate(members):
        assert chunking.virtual_rank(group[-1], p) == v  # the participant stands for v
        if len(group) == 2:
            assert chunking.virtual_rank(group[0], p) is None  # its partner sits out


def test_fold_map_example_from_the_docstring():
    assert chunking.fold_map(6) == (4, [[0, 1], [2, 3], [4], [5]])


# ----------------------------------------------------------------------------- reduce ops


@pytest.mark.parametrize("text,expected", [("sum", ReduceOp.SUM), ("SUM", ReduceOp.SUM),
                                           ("Avg", ReduceOp.AVG), (ReduceOp.MAX, ReduceOp.MAX),
                                           ("prod", ReduceOp.PROD), ("min", ReduceOp.MIN)])
def test_parse_op_accepts_names_in_any_case(text, expected):
    assert parse_op(text) is expected


@pytest.mark.parametrize("bad", ["mean", "", "product", None, 3])
def test_parse_op_rejects_unknown_ops_listing_the_choices(bad):
    with pytest.raises(ValueError) as info:
        parse_op(bad)
    assert f"op={bad!r}" in str(info.value)
    assert "sum, prod, min, max, avg" in str(info.value)


def test_combine_and_finish_compute_each_reduction():
    a, b = torch.tensor([1.0, -2.0, 3.0]), torch.tensor([4.0, 5.0, -6.0])
    expected = {"sum": [5.0, 3.0, -3.0], "prod": [4.0, -10.0, -18.0], "min": [1.0, -2.0, -6.0],
                "max": [4.0, 5.0, 3.0], "avg": [2.5, 1.5, -1.5]}
    for name, values in expected.items():
        acc = a.clone()
        combine_(acc, b, parse_op(name))
        finish_(acc, parse_op(name), 2)
        assert acc.tolist() == values, name


def test_check_dtype_rejects_meaningless_combinations():
    with pytest.raises(ValueError, match=r"op='avg' needs a floating-point tensor, got torch\.int"):
        check_dtype(torch.zeros(2, dtype=torch.int64), ReduceOp.AVG)
    with pytest.raises(ValueError, match="bool"):
        check_dtype(torch.zeros(2, dtype=torch.bool), ReduceOp.SUM)
    check_dtype(torch.zeros(2), ReduceOp.AVG)  # fine
    check_dtype(torch.zeros(2, dtype=torch.bool), ReduceOp.MAX)  # fine: logical or


# ----------------------------------------------------------------------------- flight recorder


def test_flight_recorder_records_the_lifecycle_of_each_collective():
    fr = FlightRecorder(capacity=8)
    a = fr.queued(1, "all_reduce", "ring", 400)
    b = fr.queued(2, "broadcast", "tree", 64)
    assert [r["state"] for r in fr.dump()] == ["queued", "queued"]
    fr.started(a)
    fr.ended(a)
    fr.started(b)
    fr.ended(b, TimeoutError("peer 3 is late"))
    first, second = fr.dump()
    assert (first["seq"], first["op"], first["algorithm"], first["nbytes"]) == (
        1, "all_reduce", "ring", 400)
    assert first["state"] == "completed" and first["error"] == ""
    assert first["queued_at"] <= first["started_at"] <= first["ended_at"]
    assert second["state"] == "failed"
    assert second["error"] == "TimeoutError: peer 3 is late"


def test_flight_recorder_keeps_only_the_latest_records():
    fr = FlightRecorder(capacity=3)
    for seq in range(1, 8):
        fr.queued(seq, "barrier", "naive", 0)
    assert [r["seq"] for r in fr.dump()] == [5, 6, 7]
    with pytest.raises(ValueError, match="capacity must be ≥ 1"):
        FlightRecorder(capacity=0)


def test_flight_recorder_writes_json(tmp_path):
    fr = FlightRecorder()
    fr.ended(fr.queued(1, "all_gather", "naive", 12))
    path = fr.write(tmp_path / "sub" / "fr.json", rank=2, reason="test")
    data = json.loads(path.read_text())
    assert data["rank"] == 2 and data["reason"] == "test"
    assert data["records"] == fr.dump()
    assert data["records"][0]["state"] == "completed"


def test_flight_recorder_dump_is_a_copy():
    fr = FlightRecorder()
    record = fr.queued(1, "all_reduce", "ring", 4)
    snapshot = fr.dump()
    fr.ended(record)
    assert snapshot[0]["state"] == "queued" and fr.dump()[0]["state"] == "completed"


# ----------------------------------------------------------------------------- traffic stats


def test_traffic_stats_counts_per_op_and_in_total():
    stats = TrafficStats()
    stats.count_call("all_reduce")
    stats.count_send("all_reduce", 100)
    stats.count_send("all_reduce", 50)
    stats.count_recv("all_reduce", 70)
    stats.count_call("send")
    stats.count_send("send", 8)
    stats.count_unobserved(1000)
    snap = stats.snapshot()
    assert snap["all_reduce"] == {"calls": 1, "bytes_sent": 150, "bytes_recv": 70,
                                  "msgs_sent": 2, "msgs_recv": 1}
    assert snap["send"] == {"calls": 1, "bytes_sent": 8, "bytes_recv": 0, "msgs_sent": 1,
                            "msgs_recv": 0}
    assert stats.bytes_sent == 158 and stats.bytes_recv == 70
    assert stats.bytes_unobserved == 1000
    stats.count_send("all_reduce", 1)
    assert snap["all_reduce"]["bytes_sent"] == 150  # the snapshot does not move
    stats.reset()
    assert stats.snapshot() == {} and stats.bytes_sent == 0 and stats.bytes_unobserved == 0


def test_traffic_stats_is_thread_safe():
    import threading

    stats = TrafficStats()

    def hammer() -> None:
        for _ in range(2000):
            stats.count_send("all_reduce", 3)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert stats.snapshot()["all_reduce"]["msgs_sent"] == 8000
    assert stats.bytes_sent == 24000


# ----------------------------------------------------------------------------- config, checks


@pytest.mark.parametrize("kwargs,fragment", [
    ({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"), ({"timeout_s": float("inf")}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"), ({"timeout_s": "10"}, "timeout_s"),
    ({"chunk_bytes": 0}, "chunk_bytes"), ({"chunk_bytes": -4096}, "chunk_bytes"),
    ({"chunk_bytes": 4096.0}, "chunk_bytes"), ({"chunk_bytes": "4k"}, "chunk_bytes"),
    ({"algorithm": "bogus"}, "algorithm='bogus' is unknown"),
    ({"debug_checks": "yes"}, "debug_checks"),
    ({"flight_recorder_size": 0}, "flight_recorder_size"),
    ({"flight_recorder_size": 2.5}, "flight_recorder_size"),
])
def test_comm_config_rejects_bad_values_naming_the_field(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        CommConfig(**kwargs)
    assert fragment in str(info.value)


def test_comm_config_accepts_good_values_and_lists_algorithms():
    CommConfig(timeout_s=0.5, algorithm="ring", chunk_bytes=4096, debug_checks=True)
    with pytest.raises(ValueError) as info:
        CommConfig(algorithm="rings")
    for name in ("'auto'", "ring", "naive", "tree", "halving_doubling", "native"):
        assert name in str(info.value)


def test_rank_arg_names_the_argument_and_the_valid_range():
    assert rank_arg("root", 3, 4) == 3
    with pytest.raises(ValueError, match=r"root=4 is out of range .* valid ranks are 0\.\.3"):
        rank_arg("root", 4, 4)
    with pytest.raises(TypeError, match=r"root must be an int rank, got 1\.0"):
        rank_arg("root", 1.0, 4)
    with pytest.raises(TypeError, match="root must be an int rank, got True"):
        rank_arg("root", True, 4)
    with pytest.raises(ValueError, match="dst=2 is this rank itself"):
        rank_arg("dst", 2, 4, self_rank=2)


def test_splits_arg_checks_length_sign_and_sum():
    assert splits_arg("s", None, 8, 4) == [2, 2, 2, 2]
    assert splits_arg("s", [0, 3, 1], 4, 3) == [0, 3, 1]
    with pytest.raises(ValueError, match="not divisible by world_size=3"):
        splits_arg("s", None, 8, 3)
    with pytest.raises(ValueError, match="s must be 3 non-negative ints"):
        splits_arg("s", [1, 2], 3, 3)
    with pytest.raises(ValueError, match="s must be 3 non-negative ints"):
        splits_arg("s", [4, -1, 0], 3, 3)
    with pytest.raises(ValueError, match="s sums to 5 rows but the tensor has 4"):
        splits_arg("s", [1, 2, 2], 4, 3)


# ----------------------------------------------------------------------------- ownership


class _OneRank(Transport):
    """A one-rank transport that only remembers being closed."""

    name = "one-rank-test"

    def __init__(self) -> None:
        self.closed = 0

    rank = property(lambda self: 0)  # type: ignore[assignment]
    world_size = property(lambda self: 1)  # type: ignore[assignment]
    global_ranks = property(lambda self: (0,))  # type: ignore[assignment]

    def isend(self, tensor, dst, tag):  # type: ignore[no-untyped-def]
        raise AssertionError("a one-rank collective sends nothing")

    irecv = isend

    def subgroup(self, ranks):  # type: ignore[no-untyped-def]
        return None

    def close(self) -> None:
        self.closed += 1


def test_close_leaves_a_shared_transport_open():
    shared = _OneRank()
    sibling = Communicator(shared, CommConfig(), owns_transport=False)
    t = torch.arange(4.0)
    sibling.all_reduce(t, algorithm="ring", async_op=True).wait()  # starts the thread
    sibling.close()
    assert shared.closed == 0 and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    owner = Communicator(shared, CommConfig())
    owner.close()
    assert shared.closed == 1


class _RefusesPosts(Transport):
    """Rank 0 of 2 over a transport whose every post fails, as Gloo's do once the
    connection to a dead peer broke ("Connection closed by peer" from send/recv itself)."""

    name = "refuses-posts-test"

    def __init__(self, error: BaseException) -> None:
        self.error, self.posts = error, 0

    rank = property(lambda self: 0)  # type: ignore[assignment]
    world_size = property(lambda self: 2)  # type: ignore[assignment]
    global_ranks = property(lambda self: (0, 1))  # type: ignore[assignment]

    def isend(self, tensor, dst, tag):  # type: ignore[no-untyped-def]
        self.posts += 1
        raise self.error

    irecv = isend

    def subgroup(self, ranks):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize("error", [
    ConnectionError("Connection closed by peer [127.0.0.1]:7360"),
    TimeoutError("Application timeout caused pair closure")])
@pytest.mark.parametrize("call", ["ring", "tree", "isend", "irecv"])
def test_a_refused_post_is_named_at_once(error, call):
    """A refusal is immediate, whatever Gloo's reason: PeerFailedError naming the op and
    the peer, never "timed out after …". A collective's failure poisons the communicator
    (its other messages may still be posted); a single message that was never posted does
    not, so the caller can still reach other ranks."""
    from disttrain.comm.cost_model import LinkCosts
    from disttrain.comm.errors import PeerFailedError

    transport = _RefusesPosts(error)
    comm = Communicator(transport, CommConfig(timeout_s=1.0), costs=LinkCosts())
    t = torch.ones(8)
    p2p = call in ("isend", "irecv")
    try:
        with pytest.raises(PeerFailedError) as info:
            if p2p:
                getattr(comm, call)(t, 1)
            else:
                comm.all_reduce(t, algorithm=call)
        exc = info.value
        op = {"isend": "send", "irecv": "recv"}.get(call, "all_reduce")
        assert (exc.op, exc.seq, exc.peer) == (op, 1, 1), exc
        assert "starting to" in str(exc) and str(error) in str(exc), exc
        assert "to rank 1" in str(exc) or "from rank 1" in str(exc), exc
        assert "timed out after" not in str(exc), exc
        assert exc.__cause__ is error
        counted = comm.stats.snapshot().get(op, {})  # nothing was posted: nothing counted
        assert counted.get("msgs_sent", 0) == counted.get("msgs_recv", 0) == 0, counted
        posts = transport.posts
        if p2p:
            with pytest.raises(PeerFailedError):
                comm.isend(t, 1)
            assert transport.posts == posts + 1  # still usable: it tried again
        else:
            with pytest.raises(CommError, match="failed earlier and cannot be used again"):
                comm.send(t, 1)
            assert transport.posts == posts  # refused before anything is posted
    finally:
        comm.close()


# ----------------------------------------------------------------------------- the fast path


def test_traffic_stats_count_adds_one_round_in_one_call():
    stats = TrafficStats()
    stats.count("all_reduce", 4096, 12288)
    stats.count("all_reduce", 4096, 0)  # a round that read nothing is no received message
    stats.count("broadcast", 0, 64)
    snap = stats.snapshot()
    assert snap["all_reduce"] == {"calls": 0, "bytes_sent": 8192, "bytes_recv": 12288,
                                  "msgs_sent": 2, "msgs_recv": 1}
    assert snap["broadcast"] == {"calls": 0, "bytes_sent": 0, "bytes_recv": 64,
                                 "msgs_sent": 0, "msgs_recv": 1}


def test_flight_recorder_recent_returns_only_records_since_a_time():
    fr = FlightRecorder(capacity=8)
    old = fr.queued(1, "all_reduce", "shm", 4)
    old.queued_at = 100.0
    for seq in (2, 3):
        fr.queued(seq, "all_reduce", "shm", 4).queued_at = 200.0 + seq
    assert [r["seq"] for r in fr.recent(200.0)] == [2, 3]
    assert [r["seq"] for r in fr.recent(0.0)] == [1, 2, 3]
    assert fr.recent(1e12) == []
    fr.recent(0.0)[0]["op"] = "changed"
    assert fr.dump()[0]["op"] == "all_reduce"  # copies, like dump()


def test_reduce_op_fast_lookup_agrees_with_parse_op():
    for name in ("sum", "avg", "prod", "min", "max", "SUM", "Max", ReduceOp.MIN):
        assert checks.reduce_op(name) is parse_op(name)
    with pytest.raises(ValueError, match="not a reduce op"):
        checks.reduce_op("median")
    with pytest.raises(ValueError, match="not a reduce op"):
        checks.reduce_op(["sum"])


def test_flat_detaches_only_tracked_tensors_and_shares_memory():
    plain = torch.zeros(2, 3)
    assert checks.flat(plain).shape == (6,) and checks.flat(plain).data_ptr() == plain.data_ptr()
    vector = torch.zeros(5)
    assert checks.flat(vector) is vector  # no new tensor object on the hot path
    tracked = torch.zeros(4, requires_grad=True)
    out = checks.flat(tracked)
    assert not out.requires_grad and out.data_ptr() == tracked.data_ptr()
    out += 1  # in place, as algorithms write
    assert tracked.detach().tolist() == [1.0] * 4


def test_tensor_arg_fast_path_keeps_every_check():
    assert checks.tensor_arg("t", torch.ones(3), "cpu") is not None
    with pytest.raises(TypeError, match=r"t must be a torch\.Tensor"):
        checks.tensor_arg("t", [1.0], "cpu")
    with pytest.raises(ValueError, match="not contiguous"):
        checks.tensor_arg("t", torch.ones(4, 4).t(), "cpu")
    with pytest.raises(ValueError, match="is on cpu"):
        checks.tensor_arg("t", torch.ones(3), "cuda")


def test_algorithm_choices_are_remembered_and_errors_are_not():
    comm = Communicator(_OneRank(), CommConfig())
    chooser = comm._algorithm
    assert chooser("all_reduce", "ring", 64) == "ring"
    assert chooser("all_reduce", None, 64) == chooser("all_reduce", "auto", 64)
    assert ("all_reduce", "ring", 64) in chooser._known
    for _ in range(2):  # a bad name raises every time, it is never remembered
        with pytest.raises(ValueError, match="choose one of"):
            chooser("all_reduce", "bogus", 64)
    with pytest.raises(ValueError, match="cannot run"):
        chooser("all_reduce", "shm", 64)  # not the shared-memory transport
    comm.close()
