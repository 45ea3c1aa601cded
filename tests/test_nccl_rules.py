"""The NCCL-rules test mode (disttrain.comm.nccl_rules): it fails where NCCL would, and every
algorithm and sub-communicator still works under it.

The mode must be able to fail: a toy exchange that tells its two streams apart by tags passes
on plain Gloo and fails under the rules, and a pair that posts its receive first on both sides
times out under the rules (a hang on NCCL) while Gloo completes it.
"""

from __future__ import annotations

import pytest
import torch

from disttrain.comm import CommConfig, CommTimeoutError, Communicator
from disttrain.comm.config import nccl_rules_from_env
from disttrain.comm.nccl_rules import NcclRulesTransport
from disttrain.comm.transports.torch_p2p import TorchTransport

ALGORITHMS = ["ring", "naive", "tree", "halving_doubling", "native"]


def rules_comm(timeout_s: float = 20.0) -> Communicator:
    return Communicator(NcclRulesTransport(timeout_s=timeout_s), CommConfig(timeout_s=timeout_s))


def collectives_under_rules(comm: Communicator) -> dict[str, list[float]]:
    """Every algorithm of the main collectives, twice in a row, and a sub-communicator."""
    c = rules_comm()
    p, r = c.world_size, c.rank
    out: dict[str, list[float]] = {}
    try:
        for alg in ALGORITHMS:
            for size in (1, 11):
                t = torch.arange(size, dtype=torch.float32) * (r + 1)
                c.all_reduce(t, algorithm=alg)
                out[f"all_reduce/{alg}/{size}"] = t.tolist()
        for alg in ("ring", "naive", "halving_doubling"):
            gathered = torch.zeros(3 * p)
            c.all_gather(gathered, torch.full((3,), float(r)), algorithm=alg)
            out[f"all_gather/{alg}"] = gathered.tolist()
            shard = torch.zeros(2)
            c.reduce_scatter(shard, torch.arange(2 * p, dtype=torch.float32) + r, algorithm=alg)
            out[f"reduce_scatter/{alg}/{r}"] = shard.tolist()
        moved = torch.zeros(p)
        c.all_to_all(moved, torch.full((p,), float(r)), algorithm="naive")
        out["all_to_all"] = moved.tolist()
        for alg in ("naive", "tree"):
            b = torch.full((2,), float(r))
            c.broadcast(b, root=p - 1, algorithm=alg)
            out[f"broadcast/{alg}"] = b.tolist()
            c.barrier(algorithm=alg)
        sub = c.new_group(list(reversed(range(p))))
        assert sub is not None
        t = torch.ones(5)
        sub.all_reduce(t, algorithm="ring")
        out["sub"] = t.tolist()
    finally:
        c.close()
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_algorithm_gives_the_right_answer_under_the_rules(pools, world):
    per_rank = pools(world).run(collectives_under_rules)
    p = world
    for r, out in enumerate(per_rank):
        want = sum(range(1, p + 1))
        for alg in ALGORITHMS:
            assert out[f"all_reduce/{alg}/11"] == [i * want for i in range(11)], (r, alg)
        for alg in ("ring", "naive", "halving_doubling"):
            assert out[f"all_gather/{alg}"] == [float(q) for q in range(p) for _ in range(3)]
            base = [2 * r + i for i in range(2)]
            assert out[f"reduce_scatter/{alg}/{r}"] == [p * b + sum(range(p)) for b in base]
        assert out["all_to_all"] == [float(q) for q in range(p)]
        assert out["broadcast/naive"] == out["broadcast/tree"] == [float(p - 1)] * 2
        assert out["sub"] == [float(p)] * 5


# ---------------------------------------------------------------- the mode can fail
def tag_dependent_exchange(comm: Communicator, rules: bool) -> list[float]:
    """A toy 'strategy' with two streams told apart by tags: rank 0 sends a gradient (tag 1)
    then a loss (tag 2); rank 1 posts the loss receive first. Correct on Gloo; under NCCL's
    rules the first message (the gradient) lands in the loss buffer."""
    config = CommConfig(timeout_s=10.0, nccl_rules=rules)
    c = Communicator.from_torch(config=config)
    try:
        if c.rank == 0:
            works = [c.isend(torch.tensor([1.0, 2.0]), 1, tag=1),
                     c.isend(torch.tensor([9.0, 9.0]), 1, tag=2)]
            for work in works:
                work.wait()
            return []
        loss, grad = torch.zeros(2), torch.zeros(2)
        works = [c.irecv(loss, 0, tag=2), c.irecv(grad, 0, tag=1)]
        for work in works:
            work.wait()
        return [*grad.tolist(), *loss.tolist()]
    finally:
        c.close()


def test_a_tag_dependent_strategy_passes_on_gloo_and_fails_under_the_rules(pools):
    plain = pools(2).run(tag_dependent_exchange, False)
    assert plain[1] == [1.0, 2.0, 9.0, 9.0]
    ruled = pools(2).run(tag_dependent_exchange, True)
    assert ruled[1] != [1.0, 2.0, 9.0, 9.0], "the rules let a tag-dependent stream pass"
    assert ruled[1] == [9.0, 9.0, 1.0, 2.0]  # matched in posting order, as NCCL does


def receive_first_on_both_sides(comm: Communicator, rules: bool) -> str:
    """Both ranks post a receive from the other, then a send: fine on Gloo, a hang on NCCL
    (the receive kernel blocks the pair's stream ahead of the send)."""
    c = Communicator.from_torch(config=CommConfig(timeout_s=2.0, nccl_rules=rules))
    peer = 1 - c.rank
    got = torch.zeros(3)
    try:
        works = [c.irecv(got, peer), c.isend(torch.full((3,), float(c.rank)), peer)]
        for work in works:
            work.wait()
        return f"ok {got.tolist()}"
    except CommTimeoutError as exc:
        return f"timeout: {exc}"
    finally:
        if not c.failed:
            c.close()


def test_a_pair_that_receives_first_on_both_sides_times_out_under_the_rules():
    from tests.dist import DistPool

    pool = DistPool(2)  # its own ranks: the timed-out messages leave the connections broken
    try:
        plain = pool.run(receive_first_on_both_sides, False)
        assert plain == ["ok [1.0, 1.0, 1.0]", "ok [0.0, 0.0, 0.0]"]
        ruled = pool.run(receive_first_on_both_sides, True)
        assert all(r.startswith("timeout:") and "NCCL's rules" in r for r in ruled), ruled
    finally:
        pool.close()


# ---------------------------------------------------------------- switches
def test_the_environment_turns_the_mode_on():
    assert nccl_rules_from_env({}) is False
    assert nccl_rules_from_env({"DISTTRAIN_NCCL_RULES": "1"}) is True
    assert nccl_rules_from_env({"DISTTRAIN_NCCL_RULES": "off"}) is False
    with pytest.raises(ValueError, match="DISTTRAIN_NCCL_RULES"):
        nccl_rules_from_env({"DISTTRAIN_NCCL_RULES": "maybe"})
    with pytest.raises(ValueError, match="nccl_rules"):
        CommConfig(nccl_rules="yes")  # type: ignore[arg-type]


def transport_kinds(comm: Communicator) -> list[str]:
    made = []
    for rules in (False, True):
        c = Communicator.from_torch(config=CommConfig(timeout_s=10.0, nccl_rules=rules))
        sub = c.new_group([0, 1])
        made += [type(c.transport).__name__, type(sub.transport).__name__,
                 str(c.transport.in_order)]
        c.close()
    return made


def test_from_torch_builds_the_rules_transport_and_its_groups_keep_the_rules(pools):
    kinds = pools(2).run(transport_kinds)[0]
    assert kinds == ["TorchTransport", "TorchTransport", "False",
                     "NcclRulesTransport", "NcclRulesTransport", "True"]
    assert issubclass(NcclRulesTransport, TorchTransport)


# ---------------------------------------------------------------- lazily created pairs
def first_contacts_on_two_groups(comm: Communicator, rules: bool, connect: bool) -> str:
    """Ranks 0 and 1 meet on two groups: rank 0 first receives on the second, rank 1 first
    receives on the first, each before it sends. On Gloo (pairs exist) both complete; under
    NCCL's rules each first call blocks creating a different pair communicator: a hang,
    unless both first connect the groups in one order."""
    c = Communicator.from_torch(config=CommConfig(timeout_s=3.0, nccl_rules=rules))
    first, second = c.new_group([0, 1]), c.new_group([0, 1])
    assert first is not None and second is not None
    peer, got = 1 - c.rank, torch.zeros(2)
    try:
        if connect:
            first.connect([peer])
            second.connect([peer])
        mine = torch.full((2,), float(c.rank))
        if c.rank == 0:
            works = [second.irecv(got, peer), first.isend(mine, peer)]
        else:
            works = [first.irecv(got, peer), second.isend(mine, peer)]
        for work in works:
            work.wait()
        return f"ok {got.tolist()}"
    except CommTimeoutError as exc:
        return f"timeout: {exc}"
    finally:
        if not c.failed and not first.failed and not second.failed:
            c.close()


def test_two_ranks_meeting_first_on_two_groups_in_opposite_orders_hang_under_the_rules():
    from tests.dist import DistPool

    pool = DistPool(2)  # its own ranks: a timed-out message leaves their connections broken
    try:
        assert pool.run(first_contacts_on_two_groups, False, False) == ["ok [1.0, 1.0]",
                                                                        "ok [0.0, 0.0]"]
        assert pool.run(first_contacts_on_two_groups, True, True) == ["ok [1.0, 1.0]",
                                                                      "ok [0.0, 0.0]"]
        ruled = pool.run(first_contacts_on_two_groups, True, False)
        assert all(r.startswith("timeout:") and "made no first call" in r for r in ruled), ruled
        assert "rank 1" in ruled[0] and "rank 0" in ruled[1]  # each names its peer
    finally:
        pool.close()


def ring_without_connecting(comm: Communicator, skip_connect: bool) -> str:
    """A ring all-reduce at p = 3 under the rules; ``skip_connect``: as if the collective
    did not create its pairs first (every rank's first call, a receive from the left,
    blocks on a pair whose other rank is blocked on its own left: a cycle)."""
    from disttrain.comm import algorithms
    from disttrain.comm.cost_model import load_costs

    saved = dict(algorithms.CONNECT_FIRST)
    if skip_connect:
        algorithms.CONNECT_FIRST.clear()
    # costs given: agreeing on rank 0's (a broadcast) would create pairs before the ring
    c = Communicator(NcclRulesTransport(timeout_s=3.0), CommConfig(timeout_s=3.0),
                     load_costs("torch"))
    try:
        t = torch.full((7,), float(c.rank + 1))
        c.all_reduce(t, algorithm="ring")
        return f"ok {t[0].item()}"
    except CommTimeoutError as exc:
        return f"timeout: {exc}"
    finally:
        algorithms.CONNECT_FIRST.update(saved)
        if not c.failed:
            c.close()


def test_a_ring_whose_first_contacts_cycle_hangs_under_the_rules_and_connecting_fixes_it():
    from tests.dist import DistPool

    pool = DistPool(3)
    try:
        assert pool.run(ring_without_connecting, False) == ["ok 6.0"] * 3
        ruled = pool.run(ring_without_connecting, True)
        assert all(r.startswith("timeout:") and "made no first call" in r for r in ruled), ruled
    finally:
        pool.close()


# ---------------------------------------------------------------- groups bound to a device
def one_queue_per_group(comm: Communicator, bound: bool) -> str:
    """Each rank receives from its left, then sends to its right, after the pairs exist.
    With a queue per pair every receive finds its send; with one queue per group (a group
    bound to a device) every rank's send waits behind its own receive: a hang."""
    transport = NcclRulesTransport(timeout_s=3.0, bound=bound)
    c = Communicator(transport, CommConfig(timeout_s=3.0))
    p, r = c.world_size, c.rank
    left, right = (r - 1) % p, (r + 1) % p
    try:
        c.connect([left, right])
        got = torch.zeros(1)
        works = [c.irecv(got, left), c.isend(torch.full((1,), float(r)), right)]
        for work in works:
            work.wait()
        return f"ok {got.item()}"
    except CommTimeoutError as exc:
        return f"timeout: {exc}"
    finally:
        if not c.failed:
            c.close()


def refused_on_a_bound_group(comm: Communicator) -> list[str]:
    c = Communicator(NcclRulesTransport(timeout_s=10.0, bound=True), CommConfig(timeout_s=10.0))
    out = []
    try:
        t = torch.ones(4)
        c.all_reduce(t)  # auto: native, the only algorithm a bound group serves
        out.append(f"auto {t[0].item()}")
        try:
            c.all_reduce(t, algorithm="ring")
        except ValueError as exc:
            out.append(str(exc))
    finally:
        c.close()
    return out


def test_a_group_bound_to_a_device_runs_every_message_in_one_queue():
    from tests.dist import DistPool

    pool = DistPool(3)
    try:
        assert pool.run(one_queue_per_group, False) == ["ok 2.0", "ok 0.0", "ok 1.0"]
        bound = pool.run(one_queue_per_group, True)
        assert all(r.startswith("timeout:") for r in bound), bound
    finally:
        pool.close()


def test_disttrain_collectives_refuse_a_bound_group_in_one_line(pools):
    for out in pools(3).run(refused_on_a_bound_group):
        assert out[0] == "auto 3.0"
        assert "bound to a device" in out[1] and "native" in out[1] and "\n" not in out[1]


def test_the_environment_can_model_bound_groups():
    assert nccl_rules_from_env({"DISTTRAIN_NCCL_RULES": "bound"}) == "bound"
    assert CommConfig(nccl_rules="bound").nccl_rules == "bound"


def pipelines_on_bound_groups(comm: Communicator) -> list[tuple]:
    """GPipe and 1F1B against one process, every message of every group in one queue."""
    from tests.test_pipeline_runtime import check_equivalence

    c = Communicator(NcclRulesTransport(timeout_s=10.0, bound=True), CommConfig(timeout_s=10.0))
    try:
        return check_equivalence(c, [("gpipe", 4, "params"), ("1f1b", 6, "params")])
    finally:
        c.close()


@pytest.mark.parametrize("stages", [3, 4])
def test_pipelines_run_on_groups_bound_to_a_device(pools, stages):
    # one group of all stages per channel would hang at p ≥ 3: a stage's send to the next
    # stage waits behind its receive from the previous one (a group of two per pair does not)
    per_rank = pools(stages).run(pipelines_on_bound_groups)
    assert all(len(r) == 2 for r in per_rank)


# ---------------------------------------------------------------- a dead peer is silence
def test_a_dead_peer_leaves_the_lane_silent_as_nccl_does():
    from disttrain.comm.nccl_rules import _Lane, _LaneWork

    class Broken:
        def wait(self, timeout_s: float) -> None:
            raise ConnectionError("Connection closed by peer")

    lane = _Lane(lambda kind, tensor, peer: Broken(), 5.0, "test-lane")
    first = lane.submit(_LaneWork("recv", torch.zeros(1), 1))
    lane.thread.join(5.0)  # the lane stops at the dead peer ...
    second = lane.submit(_LaneWork("recv", torch.zeros(1), 1))
    assert not first.is_completed() and not second.is_completed()  # ... and says nothing
    with pytest.raises(TimeoutError, match="did not complete"):
        first.wait(0.1)


def test_a_wait_for_a_peer_known_dead_is_its_failure_where_death_is_silent():
    from types import SimpleNamespace

    from disttrain.comm.checkin import Verdict
    from disttrain.comm.context import CollectiveContext
    from disttrain.comm.errors import PeerFailedError
    from disttrain.comm.stats import TrafficStats

    def context(in_order: bool) -> CollectiveContext:
        transport = SimpleNamespace(
            rank=0, world_size=2, in_order=in_order,
            diagnose=lambda grace: Verdict((1,), {1: "died (pid 7 on node0 is gone)"}))
        return CollectiveContext(transport, TrafficStats(), op="recv", seq=3,  # type: ignore
                                 algorithm="p2p", timeout_s=1.0, chunk_bytes=1)

    silent = context(True).failure("waiting to recv from rank 1", TimeoutError("t"), 1,
                                   timed_out=True)
    assert isinstance(silent, PeerFailedError) and silent.peer == 1
    assert "rank 1 died while this rank was waiting" in str(silent)
    gloo = context(False).failure("waiting to recv from rank 1", TimeoutError("t"), 1,
                                  timed_out=True)
    assert isinstance(gloo, CommTimeoutError)  # Gloo closes connections: a timeout is one


# ---------------------------------------------------------------- worker loss on NCCL
def _rules_connect(rank: int, world_size: int, store: str) -> Communicator:
    """As test_ps_failures.connect, under NCCL's rules, with every rank's process published
    (what disttrain.init does): the table tells a dead rank on this host from a silent one."""
    import datetime

    import torch.distributed as dist

    from disttrain.comm import liveness
    from disttrain.comm.transports.torch_p2p import job_store

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=60))
    liveness.publish(job_store(), rank)
    job_store().wait([liveness.PROC_KEY + str(r) for r in range(world_size)])
    return Communicator.from_torch(config=CommConfig(timeout_s=60.0, nccl_rules=True))


def rules_victim_main(rank: int, world_size: int, store: str, *args: object) -> None:
    from tests.test_ps_failures import play

    play(_rules_connect(rank, world_size, store), True, *args)


def rules_rank_main(rank: int, world_size: int, store: str, victim: int,
                    *args: object) -> dict[str, object]:
    import subprocess
    import sys
    import time

    from tests.ps_cases import catching
    from tests.test_ps_failures import REPO, play

    if rank != victim:
        return catching(play, _rules_connect(rank, world_size, store), False, *args)
    code = (f"from tests.test_nccl_rules import rules_victim_main; "
            f"rules_victim_main({rank}, {world_size}, {store!r}, *{args!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    return {"exit": proc.wait()}


def test_an_async_server_outlives_a_killed_worker_where_death_is_silence():
    """On NCCL a dead worker closes no connection: the server learns of it only when its
    deadline passes. It then finds the worker's process gone and goes on without it, as
    on Gloo, instead of stopping at a timeout."""
    import signal

    from tests.dist import run_fresh

    steps = 8
    results = run_fresh(rules_rank_main, 4, 1, "async", 1, steps, timeout_s=120)
    assert results[1]["exit"] == -signal.SIGKILL
    for rank in (0, 2):
        assert results[rank]["error"] is None, results[rank]
        assert results[rank]["result"].lost_workers == (1,)
    report = results[3]["result"]
    assert sorted(report.lost) == [1] and "died" in report.lost[1], report.lost
