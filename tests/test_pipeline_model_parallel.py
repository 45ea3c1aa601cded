"""Model parallelism (the plain split, no micro-batches) equals single-process training."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.parallel.pipeline.model_parallel import build_model_parallel
from tests.test_pipeline_runtime import _capture, _fresh, batches, make_model, reference


def check_model_parallel(comm, partition) -> tuple[int, ...]:
    data = batches()
    losses, grads, params = reference(data)
    mp = build_model_parallel(make_model(), comm, partition=partition)
    opt = torch.optim.SGD(mp.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = mp.train_step(x if mp.is_first else None, y if mp.is_last else None,
                             F.cross_entropy)
        assert loss == pytest.approx(losses[step], rel=1e-12)
        for name, p in mp.module.named_parameters():
            torch.testing.assert_close(p.grad, grads[step][name], msg=f"grad {name}")
        opt.step()
        assert mp.last_step is not None and mp.last_step.peak_stashed == 1
    for name, p in mp.module.named_parameters():
        torch.testing.assert_close(p.detach(), params[name], msg=f"param {name}")
    out = mp.eval_forward(data[0][0] if mp.is_first else None)
    if mp.is_last:
        model = make_model()
        model.load_state_dict(params)  # trained like mp
        with torch.no_grad():
            torch.testing.assert_close(out, model(data[0][0]))
    return tuple(sorted({int(name.split(".")[0]) for name, _ in mp.module.named_parameters()}))


@pytest.mark.nccl_rules
@pytest.mark.parametrize(("p", "partition"), [(2, "params"), (3, [3, 2, 2])])
def test_model_parallel_equals_single_process(pools, p, partition):
    layers = pools(p).run(check_model_parallel, partition)
    owned = [index for rank in layers for index in rank]
    assert owned == sorted(set(owned)) and len(set(owned)) == 4  # each Linear on one rank


def mp_mismatch(comm) -> str:
    comm = _fresh(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(10, 2))
    mp = build_model_parallel(model, comm, partition=[2, 1])
    return _capture(lambda: mp.train_step(torch.randn(4, 6), torch.randint(0, 2, (4,)),
                                          F.cross_entropy))


def test_model_parallel_shape_mismatch(pools):
    first, second = pools(2).run(mp_mismatch)
    assert "stage 1 could not run its first layer (layer 2, Linear)" in second
    assert "StageFailedError" in first and "stage 1 (rank 1) failed" in first


def mp_eval_failure(comm) -> list[str]:
    """Rank 0 fails in eval_forward (inputs of the wrong width) while rank 1 waits for its
    activation; then both try again."""
    comm = _fresh(comm)
    mp = build_model_parallel(make_model(), comm, partition=[3, 4])
    bad = torch.randn(4, 5, dtype=torch.float64)  # the model takes 6 features
    return [_capture(lambda: mp.eval_forward(bad if mp.is_first else None)),
            _capture(lambda: mp.eval_forward(bad if mp.is_first else None))]


@pytest.mark.nccl_rules
def test_model_parallel_eval_failure_reaches_the_other_rank(pools):
    """Without the failure report, rank 1 waited for the activation until the timeout."""
    (first, first_again), (second, second_again) = pools(2).run(mp_eval_failure)
    assert first.startswith("RuntimeError") and "(4x5 and 6x16)" in first
    assert second.startswith("StageFailedError") and "stage 0 (rank 0) failed" in second
    for again in (first_again, second_again):
        assert again.startswith("PipelineError: this pipeline failed in an earlier step")
