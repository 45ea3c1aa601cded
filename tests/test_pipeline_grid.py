"""The rank grid's collectives: ranks agree on the time-based split (or all fail at once),
a pp × dp grid averages only the gradients that exist (as single-process training does),
and a failed replica makes the copies of its stages in the other replicas fail too,
instead of leaving them waiting in the gradient all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.pipeline import build_pipeline
from tests.test_pipeline_runtime import _capture, _fresh, batches, make_model

STEPS = 3


class _Boom(nn.Module):
    """Identity, or an error in forward where ``fail`` is set."""

    def __init__(self, fail: bool) -> None:
        super().__init__()
        self.fail = fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("boom in forward")
        return x


# ---------------------------------------------------------------- partition="time"
def time_sample_missing_on_rank_1(comm) -> str:
    comm = _fresh(comm)
    sample = None if comm.rank == 1 else batches()[0][0]
    return _capture(lambda: build_pipeline(make_model(), comm, partition="time",
                                           microbatches=2, sample=sample))


def test_time_partition_without_a_sample_on_one_rank_fails_everywhere(pools):
    """Rank 1 has no sample: every rank raises the same error at once (before, ranks 0 and
    2 timed their layers and waited for rank 1 in the average until the timeout)."""
    messages = pools(3).run(time_sample_missing_on_rank_1)
    for message in messages:
        assert message.startswith("PartitionError: the ranks disagree about the sample batch "
                                  "of partition='time'"), message
        assert "rank 1: [0]" in message and "rank 0: [1, 1, 2, 12, 6]" in message
        assert "pass the same sample=<an input batch> on every rank" in message


def time_fails_on_rank_1(comm) -> str:
    comm = _fresh(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _Boom(fail=comm.rank == 1), nn.Linear(8, 3))
    return _capture(lambda: build_pipeline(model, comm, partition="time", microbatches=2,
                                           sample=torch.randn(4, 6)))


def test_timing_that_fails_on_one_rank_fails_everywhere(pools):
    first, failed = pools(2).run(time_fails_on_rank_1)
    assert failed == "RuntimeError: boom in forward"
    assert first == ("PartitionError: timing the layers for partition='time' failed on "
                     "rank(s) [1] (see their errors)")


# ---------------------------------------------------------------- pp × dp grid
class _WithUnused(nn.Module):
    """A linear layer plus a parameter that no forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.unused = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _unused_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), _WithUnused(), nn.Linear(8, 4)).double()


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


def grid_with_unused_parameter(comm) -> list[str]:
    """pp 2 × dp 2 against one process on the full batch; returns the names whose
    gradient stayed None."""
    data = batches(rows=8, steps=STEPS)
    reference = _unused_model()
    opt = _sgd(reference.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    pipe = build_pipeline(_unused_model(), _fresh(comm), schedule="1f1b", microbatches=2,
                          partition=[2, 2], pp_size=2)
    rows = slice(pipe.mesh.dp_rank * 4, pipe.mesh.dp_rank * 4 + 4)
    opt = _sgd(pipe.parameters())
    for x, y in data:
        opt.zero_grad()
        pipe.train_step(x[rows] if pipe.is_first else None, y[rows] if pipe.is_last else None,
                        F.cross_entropy)
        opt.step()
    expected = dict(reference.named_parameters())
    for name, p in pipe.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name].detach(), msg=name)
    return sorted(name for name, p in pipe.named_parameters() if p.grad is None)


def test_a_parameter_without_gradient_stays_untouched_like_single_process(pools):
    """Weight decay and momentum skip a parameter whose .grad is None; the grid must leave
    it None (not zeros) when no replica has a gradient for it."""
    per_rank = pools(4).run(grid_with_unused_parameter)
    assert per_rank == [[], ["2.unused"], [], ["2.unused"]]  # stage 1 holds layer 2


def replica_0_fails(comm) -> list[str]:
    """Rank 1 (stage 1 of replica 0) raises in forward; every rank reports its error, then
    what a second step says."""
    comm = _fresh(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8),
                          _Boom(fail=comm.rank == 1), nn.Linear(8, 3))
    pipe = build_pipeline(model, comm, schedule="1f1b", microbatches=2, partition=[2, 3],
                          pp_size=2)
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))

    def step() -> None:
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                        F.cross_entropy)

    return [_capture(step), _capture(step)]


def test_a_failed_replica_stops_the_other_replicas(pools):
    (r0, again0), (r1, again1), (r2, again2), (r3, again3) = pools(4).run(replica_0_fails)
    assert r1 == "RuntimeError: boom in forward"
    assert r0.startswith("StageFailedError") and "stage 1 (rank 1) failed" in r0
    for rank, message, stage, failed_rank in ((2, r2, 0, 0), (3, r3, 1, 1)):
        assert message.startswith(f"StageFailedError: stage {stage} of replica 1 stopped: the "
                                  f"step failed in replica(s) [0] (stage {stage} there is "
                                  f"rank(s) [{failed_rank}]"), (rank, message)
        assert "the gradients were not averaged" in message
    for again in (again0, again1, again2, again3):
        assert again.startswith("PipelineError: this pipeline failed in an earlier step")
