"""DataParallel on real ranks: equivalence with one process on the global batch, consistency
checks, unused parameters, buffers, and overlap of communication with backward.

Rank functions are module-level (they are sent to the pool's processes); the single-process
references are computed here, in the test process, from the same seeds.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import CommConfig, Communicator
from disttrain.comm.transports import ShmConfig, make_transport
from disttrain.parallel import DataParallel, UnusedParametersError

STEPS = 3
BATCH = 4  # per rank, per micro-batch
SMALL_CAPS = {"first_bucket_mb": 400 / 2**20, "bucket_cap_mb": 1000 / 2**20}  # → 3 buckets


def make_model(seed: int, hidden: int = 16, extra: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, hidden),
              nn.Tanh(), nn.Linear(hidden, 3)]
    if extra:
        layers.append(nn.Linear(3, 3))
    return nn.Sequential(*layers).double()


def make_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(n, 1, 8, 8, generator=gen, dtype=torch.float64),
            torch.randint(0, 3, (n,), generator=gen))


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def ddp_train(comm: Communicator, opt_name: str, accum: int, caps: dict[str, float],
              set_to_none: bool) -> dict[str, Any]:
    """K steps on this rank's rows of each global batch; micro-batch a of rank r is rows
    [(a·p + r)·b, (a·p + r + 1)·b). Ranks > 0 start from other weights: the broadcast fixes it."""
    p, r = comm.world_size, comm.rank
    model = make_model(7 if r == 0 else 100 + r)
    ddp = DataParallel(model, comm, **caps)
    opt = make_optimizer(opt_name, ddp.parameters())
    for step in range(STEPS):
        x, y = make_batch(step, p * BATCH * accum)
        for a in range(accum):
            rows = slice((a * p + r) * BATCH, (a * p + r + 1) * BATCH)
            with ddp.no_sync() if a < accum - 1 else nullcontext():
                loss = F.cross_entropy(ddp(x[rows]), y[rows]) / accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return {"params": [t.detach().clone() for t in model.parameters()],
            "buckets": len(ddp.buckets)}


def reference_train(opt_name: str, global_batch: int) -> list[torch.Tensor]:
    model = make_model(7)
    opt = make_optimizer(opt_name, model.parameters())
    for step in range(STEPS):
        x, y = make_batch(step, global_batch)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [t.detach() for t in model.parameters()]


def assert_replicas_match(results: list[dict[str, Any]], expected: list[torch.Tensor]) -> None:
    for rank, result in enumerate(results):
        for got, want in zip(result["params"], expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11,
                                       msg=lambda m, rank=rank: f"rank {rank}: {m}")
        for got, first in zip(result["params"], results[0]["params"]):
            assert torch.equal(got, first), f"rank {rank} differs from rank 0"


@pytest.mark.nccl_rules
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_equivalence_with_one_process_on_the_global_batch(pools, world_size, opt_name, accum):
    results = pools(world_size).run(ddp_train, opt_name, accum, SMALL_CAPS, accum == 1)
    assert all(res["buckets"] == 3 for res in results)  # the model really is split
    assert_replicas_match(results, reference_train(opt_name, world_size * BATCH * accum))


def test_equivalence_with_default_buckets(pools):
    # zero_grad(set_to_none=True) with accumulation: no_sync builds a fresh .grad, which the
    # synced backward adds to and the hook then moves into the bucket.
    results = pools(2).run(ddp_train, "adam", 2, {}, True)
    assert results[0]["buckets"] == 1
    assert_replicas_match(results, reference_train("adam", 2 * BATCH * 2))


# ---------------------------------------------------------------------- consistency checks
def build_mismatched(comm: Communicator, how: str) -> str:
    kwargs = {"hidden": 17} if how == "shape" else {"extra": True}
    model = make_model(0, **kwargs) if comm.rank == 1 else make_model(0)
    try:
        DataParallel(model, comm)
    except ValueError as exc:
        comm.barrier()  # the communicator is still in step on every rank
        return str(exc)
    return "no error"


def test_shape_mismatch_is_reported_on_every_rank(pools):
    messages = pools(3).run(build_mismatched, "shape")
    for message in messages:
        assert "#2 differs" in message
        assert "rank 0 has '3.weight' (16, 144) torch.float64" in message
        assert "rank 1 has '3.weight' (17, 144) torch.float64" in message


def test_parameter_count_mismatch_is_reported_on_every_rank(pools):
    messages = pools(2).run(build_mismatched, "count")
    for message in messages:
        assert "rank 0 has no parameter or buffer #6 (it has 6)" in message
        assert "rank 1 has '6.weight' (3, 3) torch.float64" in message


# ---------------------------------------------------------------------- unused parameters
class Branchy(nn.Module):
    """``head_b`` is used only when asked; ``never`` is never used."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.trunk = nn.Linear(5, 6)
        self.head_a = nn.Linear(6, 2)
        self.head_b = nn.Linear(6, 2)
        self.never = nn.Linear(2, 2)
        self.double()

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head_a(h) + self.head_b(h) if use_b else self.head_a(h)


def branchy_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(50 * step + rank)
    return (torch.randn(BATCH, 5, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, 2, generator=gen, dtype=torch.float64))


def unused_without_opt_in(comm: Communicator, only_rank_1: bool) -> str:
    model = Branchy()
    if only_rank_1:
        model.never.requires_grad_(False)  # frozen parameters are not synchronized at all
    ddp = DataParallel(model, comm)
    x, y = branchy_batch(0, comm.rank)
    use_b = comm.rank != 1 if only_rank_1 else True
    try:
        F.mse_loss(ddp(x, use_b=use_b), y).backward()
    except UnusedParametersError as exc:
        message = str(exc)
    else:
        message = "ok"
    comm.barrier()  # every rank issued the same collectives: nothing is left hanging
    return message


def test_unused_parameters_raise_naming_them(pools):
    for message in pools(2).run(unused_without_opt_in, False):
        assert "'never.weight', 'never.bias'" in message
        assert "find_unused_parameters=True" in message


def test_unused_on_one_rank_raises_there_without_hanging_the_others(pools):
    messages = pools(2).run(unused_without_opt_in, True)
    assert messages[0] == "ok"
    assert "2 parameter(s) received no gradient in this backward on rank 1: 'head_b.weight', " \
           "'head_b.bias'." in messages[1]


def unused_with_opt_in(comm: Communicator) -> dict[str, Any]:
    model = Branchy()
    ddp = DataParallel(model, comm, find_unused_parameters=True, first_bucket_mb=1e-5,
                       bucket_cap_mb=1e-4)
    opt = make_optimizer("adamw", ddp.parameters())
    for step in range(STEPS):
        x, y = branchy_batch(step, comm.rank)
        F.mse_loss(ddp(x, use_b=comm.rank == 0), y).backward()
        grads_none = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return {"params": [t.detach().clone() for t in model.parameters()],
            "grads_none": grads_none, "buckets": len(ddp.buckets)}


@pytest.mark.nccl_rules
def test_find_unused_parameters_matches_one_process(pools):
    p = 3
    results = pools(p).run(unused_with_opt_in)
    model = Branchy()
    opt = make_optimizer("adamw", model.parameters())
    for step in range(STEPS):  # the mean over ranks of each rank's mean loss
        batches = [branchy_batch(step, r) for r in range(p)]
        losses = [F.mse_loss(model(x, use_b=r == 0), y) for r, (x, y) in enumerate(batches)]
        (sum(losses) / p).backward()
        expected_none = {n: q.grad is None for n, q in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    assert results[0]["buckets"] > 1
    assert expected_none["never.weight"] and not expected_none["head_b.weight"]
    assert all(res["grads_none"] == expected_none for res in results)
    assert_replicas_match(results, [t.detach() for t in model.parameters()])


# ---------------------------------------------------------------------- buffers
def batchnorm_buffers(comm: Communicator) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=0.1))
    ddp = DataParallel(model, comm)
    bn = model[1]
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(8, 3, generator=gen)
    with torch.no_grad():  # replicas drift apart (e.g. different data): rank 0's must win
        bn.running_mean.fill_(5.0 if comm.rank == 0 else 100.0)
        bn.num_batches_tracked.fill_(7 if comm.rank == 0 else 0)
    ddp(x).sum().backward()
    with torch.no_grad():
        batch_mean = model[0](x).mean(0)
    synced = {"running_mean": bn.running_mean.clone(), "batch_mean": batch_mean,
              "tracked": int(bn.num_batches_tracked)}
    with torch.no_grad():
        bn.running_mean.fill_(5.0 if comm.rank == 0 else 100.0)
    with ddp.no_sync():  # no broadcast inside no_sync (nor under no_grad)
        ddp(x).sum().backward()
    synced["unsynced_mean"] = bn.running_mean.clone()
    return synced


def test_buffers_are_broadcast_from_rank_0_before_forward(pools):
    for rank, res in enumerate(pools(2).run(batchnorm_buffers)):
        torch.testing.assert_close(res["running_mean"], 0.9 * 5.0 + 0.1 * res["batch_mean"])
        assert res["tracked"] == 8
        start = 5.0 if rank == 0 else 100.0
        torch.testing.assert_close(res["unsynced_mean"], 0.9 * start + 0.1 * res["batch_mean"])


# ---------------------------------------------------------------------- overlap
def record_launches(comm: Communicator) -> dict[str, Any]:
    model = make_model(0)
    ddp = DataParallel(model, comm, **SMALL_CAPS)
    params = list(model.parameters())
    fired: list[tuple[int, int]] = []  # (hooks fired so far, buckets launched) at each hook

    def hook(_: torch.Tensor) -> None:
        fired.append((len(fired) + 1, ddp.reducer.launched))

    for q in params:  # registered after DataParallel's: runs right after it, in backward
        q.register_post_accumulate_grad_hook(hook)
    x, y = make_batch(0, BATCH)
    F.cross_entropy(ddp(x), y).backward()
    timing, report = ddp.last_sync, ddp.last_overlap()
    return {"fired": fired, "n_params": len(params), "buckets": len(ddp.buckets),
            "first_launch_before_end": timing.launched_at[0] < timing.backward_end,
            "launches": len(timing.launched_at), "comm_s": report.comm_s,
            "hidden": report.hidden_fraction}


@pytest.mark.nccl_rules
def test_first_bucket_is_launched_while_backward_still_runs(pools):
    for res in pools(2).run(record_launches):
        n = res["n_params"]
        assert len(res["fired"]) == n
        # Some hook saw a launched bucket while other gradients were still to come.
        assert any(launched >= 1 and count < n for count, launched in res["fired"]), res
        assert res["fired"][-1][1] == res["buckets"] == res["launches"] == 3
        assert res["first_launch_before_end"]
        assert res["comm_s"] > 0 and 0.0 <= res["hidden"] <= 1.0


# ---------------------------------------------------------------------- configuration
def test_config_errors_say_what_to_fix():
    from disttrain.parallel import DataParallelConfig

    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        DataParallelConfig(bucket_cap_mb=0)
    with pytest.raises(ValueError, match="not an all-reduce algorithm"):
        DataParallelConfig(algorithm="bogus")
    with pytest.raises(ValueError, match="find_unused_parameters must be True or False"):
        DataParallelConfig(find_unused_parameters="yes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- shared memory
def ddp_train_on_shm(_comm: Communicator, opt_name: str, accum: int) -> dict[str, Any]:
    """ddp_train over the shared-memory transport and its own all-reduce algorithm. With a
    512-byte one-shot limit the middle bucket (18,560 bytes) lives in a shared buffer and is
    all-reduced in place; the other two (408 and 320 bytes) are ordinary and go through one
    slot."""
    transport = make_transport("shm", shm_config=ShmConfig(one_shot_max_bytes=512))
    comm = Communicator(transport, CommConfig(timeout_s=20))
    try:
        out = ddp_train(comm, opt_name, accum, {**SMALL_CAPS, "algorithm": "shm"}, accum == 1)
        return {**out, "shared": len(transport.buffers)}  # type: ignore[attr-defined]
    finally:
        comm.close()


@pytest.mark.parametrize("world_size", [2, 3])
def test_equivalence_on_shared_memory(pools, world_size):
    results = pools(world_size).run(ddp_train_on_shm, "adam", 2)
    assert all(res["buckets"] == 3 and res["shared"] == 1 for res in results)
    assert_replicas_match(results, reference_train("adam", world_size * BATCH * 2))


def threads_of_each_bucket(comm: Communicator) -> dict[str, int]:
    """How many of one backward's bucket all-reduces ran on the progress thread (one bucket:
    the default caps hold the whole model)."""
    ddp = DataParallel(make_model(0), comm)
    before = comm._progress.completed
    x, y = make_batch(0, BATCH)
    F.cross_entropy(ddp(x), y).backward()
    return {"queued": comm._progress.completed - before, "buckets": len(ddp.buckets)}


def test_last_bucket_is_reduced_on_the_backward_thread(pools):
    """Nothing is left to overlap the last bucket with: when the progress thread is idle
    (always, with one bucket) it runs where backward runs, with no thread hand-off."""
    for res in pools(2).run(threads_of_each_bucket):
        assert res == {"queued": 0, "buckets": 1}
