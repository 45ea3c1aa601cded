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
