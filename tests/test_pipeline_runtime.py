"""The pipeline on real ranks equals single-process training on the full batch (GPipe, 1F1B,
p ∈ {2, 3, 4}, several micro-batch counts, a pp × dp grid), and its failures are errors
that name the stages, on every rank, instead of hangs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.pipeline import build_pipeline

ROWS = 12
STEPS = 3


def make_model(width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 12), nn.Tanh(), nn.Linear(12, 4)).double()


def batches(rows: int = ROWS, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=gen, dtype=torch.float64),
             torch.randint(0, 4, (rows,), generator=gen)) for _ in range(steps)]


def reference(data) -> tuple[list[float], list[dict], dict]:
    """Single-process training on the full batches: losses, gradients per step, parameters."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_and_compare(pipe, data, ref, shard=slice(None)) -> None:
    """Train ``pipe`` on ``data`` (this replica's ``shard`` of each batch) and compare."""
    losses, grads, params = ref
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = pipe.train_step(x[shard] if pipe.is_first else None,
                               y[shard] if pipe.is_last else None, F.cross_entropy)
        assert loss == pytest.approx(losses[step], rel=1e-12)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[step][name], msg=f"grad {name} step {step}")
        opt.step()
    names = [n for n, _ in pipe.named_parameters()]
    assert names, "every stage holds parameters in these tests"
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], msg=f"param {name}")


def check_equivalence(comm, cases) -> list[tuple]:
    """Run every (schedule, microbatches, partition) case; returns each stage's balance."""
    data = batches()
    ref = reference(data)
    seen = []
    for schedule, m, partition in cases:
        pipe = build_pipeline(make_model(), comm, schedule=schedule, microbatches=m,
                              partition=partition)
        train_and_compare(pipe, data, ref)
        seen.append((schedule, m, pipe.balance))
        out = pipe.eval_forward(data[0][0] if pipe.is_first else None)
        trained = make_model()
        trained.load_state_dict(ref[2])
        with torch.no_grad():
            expected = trained(data[0][0])
        if pipe.is_last:
            torch.testing.assert_close(out, expected)
        else:
            assert out is None
        shared = pipe.share_from_last(float(out.sum()) if out is not None else -1.0)
        assert shared == pytest.approx(float(expected.sum()))
    return seen


CASES = {
    2: [("gpipe", 1, "params"), ("gpipe", 4, "params"), ("1f1b", 5, [3, 4]),
        ("1f1b", 12, "params"), ("1f1b", 1, "params")],
    3: [("gpipe", 2, "params"), ("1f1b", 2, "params"), ("gpipe", 5, [1, 3, 3]),
        ("1f1b", 6, [2, 2, 3])],
    4: [("gpipe", 3, "params"), ("1f1b", 3, [2, 2, 2, 1]), ("1f1b", 8, "params"),
        ("gpipe", 8, [1, 2, 2, 2])],
}


@pytest.mark.nccl_rules
@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_equals_single_process(pools, p):
    per_rank = pools(p).run(check_equivalence, CASES[p])
    assert all(rank == per_rank[0] for rank in per_rank)  # every rank used the same split
    assert [len(balance) for _, _, balance in per_rank[0]] == [p] * len(CASES[p])


def check_grid(comm, schedule: str, pp_size: int) -> tuple[int, int]:
    data = batches(rows=16)
    ref = reference(data)
    pipe = build_pipeline(make_model(), comm, schedule=schedule, microbatches=3,
                          pp_size=pp_size)
    share = 16 // pipe.mesh.dp_size
    rows = slice(pipe.mesh.dp_rank * share, (pipe.mesh.dp_rank + 1) * share)
    train_and_compare(pipe, data, ref, shard=rows)
    x = data[0][0]
    out = pipe.eval_forward(x[rows] if pipe.is_first else None)
    shared = pipe.share_from_last(float(out.sum()) if out is not None else -1.0)
    trained = make_model()
    trained.load_state_dict(ref[2])
    with torch.no_grad():  # the mean over replicas of each replica's output sum
        assert shared == pytest.approx(float(trained(x).sum()) / pipe.mesh.dp_size)
    return pipe.mesh.pp_rank, pipe.mesh.dp_rank


@pytest.mark.parametrize(("schedule", "pp_size", "places"), [
    ("gpipe", 2, [(0, 0), (1, 0), (0, 1), (1, 1)]),
    ("1f1b", 2, [(0, 0), (1, 0), (0, 1), (1, 1)]),
    ("1f1b", 1, [(0, 0), (0, 1), (0, 2), (0, 3)]),  # no pipeline: four data-parallel copies
])
@pytest.mark.nccl_rules
def test_pp_dp_grid_equals_single_process(pools, schedule, pp_size, places):
    assert pools(4).run(check_grid, schedule, pp_size) == places


def measure_peaks(comm, m: int) -> dict[str, tuple[int, int]]:
    data = batches()
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        pipe = build_pipeline(make_model(width=64), comm, schedule=schedule, microbatches=m)
        pipe.train_step(data[0][0], data[0][1], F.cross_entropy)
        stats = pipe.last_step
        assert stats is not None and stats.busy_s > 0 and 0 <= stats.idle_fraction < 1
        peaks[schedule] = (stats.peak_stashed, stats.peak_activation_bytes)
    return peaks


def test_1f1b_holds_fewer_activations_than_gpipe(pools):
    p, m = 3, 6
    per_rank = pools(p).run(measure_peaks, m)
    for stage, peaks in enumerate(per_rank):
        assert peaks["gpipe"][0] == m
        assert peaks["1f1b"][0] == p - stage
        assert 0 < peaks["1f1b"][1] < peaks["gpipe"][1]


# ---------------------------------------------------------------- failures, on a fresh group
def _fresh(comm):
    """A new group over the same ranks: a failed case leaves messages in flight, which must
    not reach the next case (different group, different channel)."""
    return comm.new_group(list(range(comm.world_size)))


def _capture(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def shape_mismatch(comm) -> str:
    comm = _fresh(comm)
    torch.manual_seed(0)
    # layer 2 expects 10 features but layer 1 gives 16: the boundary between stages 0 and 1
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(10, 4), nn.Tanh(),
                          nn.Linear(4, 4), nn.Linear(4, 2))
    pipe = build_pipeline(model, comm, schedule="gpipe", microbatches=2, partition=[2, 2, 2])
    x, y = torch.randn(8, 6), torch.randint(0, 2, (8,))
    return _capture(lambda: pipe.train_step(x, y, F.cross_entropy))


def test_shape_mismatch_is_an_error_on_every_rank(pools):
    messages = pools(3).run(shape_mismatch)
    assert "stage 1 could not run its first layer (layer 2, Linear)" in messages[1]
    assert "shape (4, 16)" in messages[1] and "received from stage 0 (rank 0)" in messages[1]
    for rank in (0, 2):
        assert messages[rank].startswith("StageFailedError")
        assert "stage 1 (rank 1) failed" in messages[rank]


def batch_too_small(comm) -> str:
    comm = _fresh(comm)
    pipe = build_pipeline(make_model(), comm, microbatches=8)
    x, y = batches(rows=5)[0]
    return _capture(lambda: pipe.train_step(x, y, F.cross_entropy))


def test_batch_smaller_than_microbatches(pools):
    first, last = pools(2).run(batch_too_small)
    assert "a batch of 5 samples (inputs) cannot be split into 8 micro-batches" in first
    assert "use at most 5 micro-batches" in first
    assert "a batch of 5 samples (targets)" in last


def disagree(comm) -> str:
    return _capture(lambda: build_pipeline(make_model(), comm, microbatches=4 + comm.rank))


def test_ranks_that_disagree_fail_at_build_time(pools):
    for message in pools(2).run(disagree):
        assert "disagree about the pipeline" in message
        assert "rank 0: [2, 4, " in message and "rank 1: [2, 5, " in message


def different_batches(comm) -> str:
    comm = _fresh(comm)
    pipe = build_pipeline(make_model(), comm, microbatches=2)
    x, y = batches(rows=8 if comm.rank == 0 else 6)[0]
    return _capture(lambda: pipe.train_step(x, y, F.cross_entropy))


def test_inputs_and_targets_of_different_lengths(pools):
    first, last = pools(2).run(different_batches)
    assert "targets of 3 rows for micro-batch 0 but stage 0 cut that micro-batch with 4" in last
    assert "StageFailedError" in first


def time_partition(comm) -> tuple[int, ...]:
    pipe = build_pipeline(make_model(), comm, partition="time", microbatches=2,
                          sample=batches()[0][0])
    return pipe.balance


def test_time_partition_agrees_across_ranks(pools):
    balances = pools(3).run(time_partition)
    assert balances[0] == balances[1] == balances[2] and sum(balances[0]) == 7


class _FailsInBackward(nn.Module):
    """Identity whose backward raises on the second micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            def explode(grad: torch.Tensor) -> torch.Tensor:
                raise RuntimeError("backward exploded")
            x = x.clone()
            x.register_hook(explode)
        return x


def backward_failure(comm) -> str:
    comm = _fresh(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _FailsInBackward(), nn.Linear(8, 3))
    pipe = build_pipeline(model, comm, schedule="gpipe", microbatches=3, partition=[2, 2])
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    first = _capture(lambda: pipe.train_step(x, y, F.cross_entropy))
    return first + " | then: " + _capture(lambda: pipe.train_step(x, y, F.cross_entropy))


@pytest.mark.nccl_rules
def test_failure_in_backward_reaches_the_other_stage(pools):
    first, last = pools(2).run(backward_failure)
    assert "backward exploded" not in first and "StageFailedError" in first
    assert "stage 1 (rank 1) failed" in first
    assert "then: PipelineError: this pipeline failed in an earlier step" in first
    assert last.startswith("RuntimeError: backward exploded")
    assert "then: PipelineError: this pipeline failed in an earlier step" in last
