"""Interleaved 1F1B on real ranks (v chunks per stage, messages round a ring) equals one
process: loss, gradients every step and parameters after Adam steps (float64), evaluation,
and state dicts under the model's own names; a failure reaches every stage round the ring;
settings it cannot run are one-line errors before any message."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.pipeline import build_pipeline, interleaved, simulate
from tests.test_pipeline_runtime import _capture, _FailsInBackward, _fresh, batches, make_model


def adam_reference(data) -> tuple[list[float], list[dict], nn.Module]:
    """One process on the full batches: losses, gradients per step, the trained model."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses, grads = [], []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return losses, grads, model


def check_interleaved(comm, cases) -> list[tuple]:
    """Every (virtual stages, micro-batches, partition) case against one process; returns
    what each rank held: the balance of the p·v pieces, its parameter names, its peak."""
    data = batches()
    losses, grads, trained = adam_reference(data)
    seen = []
    for v, m, partition, _ in cases:
        pipe = build_pipeline(make_model(), comm, schedule="1f1b", microbatches=m,
                              partition=partition, virtual_stages=v)
        assert len(pipe.chunks) == v
        opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None,
                                   F.cross_entropy)
            assert loss == pytest.approx(losses[step], rel=1e-12)
            for name, p in pipe.named_parameters():
                torch.testing.assert_close(p.grad, grads[step][name], msg=f"{name} {step}")
            opt.step()
        state = pipe.state_dict()  # the model's own names: the stages' dicts make the model's
        want = trained.state_dict()
        for name, tensor in state.items():
            torch.testing.assert_close(tensor, want[name], msg=name)
        out = pipe.eval_forward(data[0][0] if pipe.is_first else None)
        with torch.no_grad():
            expected = trained(data[0][0])
        if pipe.is_last:
            torch.testing.assert_close(out, expected)
        else:
            assert out is None
        assert pipe.share_from_last(float(out.sum()) if out is not None else 0.0) == (
            pytest.approx(float(expected.sum())))
        pipe.load_state_dict(make_model().state_dict())  # back to the start, by name
        for name, tensor in pipe.state_dict().items():
            torch.testing.assert_close(tensor, make_model().state_dict()[name], msg=name)
        seen.append((pipe.balance, sorted(state), pipe.last_step.peak_stashed))
    return seen


CASES = {  # (v, m, partition, the balance of the p·v pieces); make_model has 7 layers
    2: [(2, 4, "params", (1, 2, 2, 2)), (3, 2, [1, 1, 1, 1, 1, 2], (1, 1, 1, 1, 1, 2))],
    3: [(2, 6, "params", (1, 1, 1, 1, 1, 2)),
        (2, 3, ["2", "3", "4", "5", "6"], (2, 1, 1, 1, 1, 1))],  # split points by name
}


@pytest.mark.nccl_rules
@pytest.mark.parametrize("p", [2, 3])
def test_interleaved_equals_single_process(pools, p):
    per_rank = pools(p).run(check_interleaved, CASES[p])
    whole = set(make_model().state_dict())
    for case, (v, m, _, balance) in enumerate(CASES[p]):
        held = [rank[case] for rank in per_rank]
        assert [pieces for pieces, _, _ in held] == [balance] * p
        names = [name for _, keys, _ in held for name in keys]
        assert sorted(names) == sorted(whole)  # every parameter on exactly one rank
        # what each rank held at its peak is what the schedule says on paper
        assert tuple(peak for _, _, peak in held) == simulate(
            interleaved(p, v, m)).peak_in_flight


def check_grid(comm) -> tuple[int, int, list[str]]:
    """2 replicas of a 2-stage pipeline of 2 chunks each: replica r trains on half of
    every batch, the stages average their gradients over dp."""
    data = batches(rows=16)
    losses, grads, trained = adam_reference(data)
    pipe = build_pipeline(make_model(), comm, microbatches=4, pp_size=2, virtual_stages=2)
    mesh = pipe.mesh
    rows = slice(mesh.dp_rank * 8, (mesh.dp_rank + 1) * 8)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = pipe.train_step(x[rows] if pipe.is_first else None,
                               y[rows] if pipe.is_last else None, F.cross_entropy)
        assert loss == pytest.approx(losses[step], rel=1e-12)
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, grads[step][name], msg=f"{name} {step}")
        opt.step()
    for name, tensor in pipe.state_dict().items():
        torch.testing.assert_close(tensor, trained.state_dict()[name], msg=name)
    return mesh.pp_rank, mesh.dp_rank, sorted(pipe.state_dict())


def test_pp_dp_grid_of_interleaved_pipelines_equals_single_process(pools):
    places = pools(4).run(check_grid)
    assert [(pp, dp) for pp, dp, _ in places] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert places[0][2] == places[2][2] and places[1][2] == places[3][2]  # dp copies


def ring_failure(comm) -> str:
    comm = _fresh(comm)
    torch.manual_seed(0)
    # six one-layer pieces on 3 ranks: the failing layer is piece 4, rank 1's chunk 1
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          _FailsInBackward(), nn.Linear(8, 3))
    pipe = build_pipeline(model, comm, microbatches=3, partition=[1] * 6, virtual_stages=2)
    x, y = torch.randn(6, 6), torch.randint(0, 3, (6,))
    first = _capture(lambda: pipe.train_step(x, y, F.cross_entropy))
    return first + " | then: " + _capture(lambda: pipe.train_step(x, y, F.cross_entropy))


@pytest.mark.nccl_rules
def test_a_failure_reaches_every_stage_round_the_ring(pools):
    messages = pools(3).run(ring_failure)
    assert messages[1].startswith("RuntimeError: backward exploded"), messages[1]
    for rank in (0, 2):
        assert messages[rank].startswith("StageFailedError"), messages[rank]
        assert "stage 1 (rank 1) failed" in messages[rank]
    assert all("then: PipelineError: this pipeline failed in an earlier step" in message
               for message in messages)


@pytest.mark.parametrize("settings,message", [
    ({"schedule": "gpipe"}, "virtual_stages=2 interleaves the 1f1b schedule; schedule "
                            "'gpipe' has no interleaved form"),
    ({"microbatches": 3}, "in groups of 2, as Megatron-LM does: use a multiple of 2 "
                          "micro-batches, not 3"),
    ({"virtual_stages": 4}, "cannot cut 7 layers into 2 stages × 4 virtual stages = 8 "
                            "pieces"),
    ({"pp_size": 1}, "this pipeline has 1: use pp_size ≥ 2 or virtual_stages=1"),
    ({"virtual_stages": 0}, "virtual_stages must be an integer ≥ 1, got 0"),
])
def test_what_cannot_interleave_is_refused_before_any_message(settings, message):
    comm = SimpleNamespace(world_size=2, rank=0)  # refused before it is used
    kwargs = {"microbatches": 4, "virtual_stages": 2, **settings}
    with pytest.raises(ValueError) as info:
        build_pipeline(make_model(), comm, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value) and "\n" not in str(info.value)
