"""Mixed precision: autocast choices, and a loss scaler whose skip decision every rank shares."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import DataParallel, LossScaler, LossScalerConfig, autocast


def test_autocast_runs_matmuls_in_bf16_on_cpu():
    layer = nn.Linear(4, 3)
    with autocast("cpu", "bf16"):
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32
    with autocast("cpu", None):
        assert layer(torch.randn(2, 4)).dtype == torch.float32


def test_autocast_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="must be 'bf16', 'fp16' or None"):
        autocast("cpu", "int8")
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda'"):
        autocast("mps", "bf16")


def test_fp16_autocast_runs_on_cpu_too():
    """(slowly: it is there so that fp16 training with loss scaling runs in CI)"""
    layer = nn.Linear(4, 3)
    with autocast("cpu", "fp16"):
        assert layer(torch.randn(2, 4)).dtype == torch.float16


def test_scale_backs_off_on_overflow_and_grows_after_the_interval():
    param = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = LossScaler(None, LossScalerConfig(init_scale=8.0, growth_interval=2))
    for grad, expected_scale in [([1.0, 2.0, float("inf")], 4.0), ([8.0, 8.0, 8.0], 4.0),
                                 ([4.0, 4.0, 4.0], 8.0)]:
        param.grad = torch.tensor(grad)
        scaler.step(opt)
        scaler.update()
        assert scaler.scale_value == expected_scale
    # the inf step was skipped; the two others moved by grad / scale = 2 and 1
    torch.testing.assert_close(param.detach(), torch.full((3,), -2.0))
    state = scaler.state_dict()
    other = LossScaler(None)
    other.load_state_dict(state)
    assert (other.scale_value, other.growth_tracker, other.skipped_steps) == (8.0, 0, 1)


def test_scaler_config_and_state_errors():
    with pytest.raises(ValueError, match="backoff_factor must be in"):
        LossScalerConfig(backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_interval must be a positive int"):
        LossScalerConfig(growth_interval=0)
    with pytest.raises(ValueError, match="missing"):
        LossScaler().load_state_dict({"scale": 2.0})
    with pytest.raises(RuntimeError, match="needs a step"):
        LossScaler().update()


def skip_on_one_rank(comm: Communicator, bad_rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    ddp = DataParallel(model, comm)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = LossScaler(comm, LossScalerConfig(init_scale=1024.0, growth_interval=100))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(comm.rank))
    y = torch.randn(4, 2, generator=torch.Generator().manual_seed(10 + comm.rank))
    before = [t.detach().clone() for t in model.parameters()]
    with autocast("cpu", "bf16"):
        loss = F.mse_loss(ddp(x).float(), y)
    scaler.scale(loss).backward()
    grad_dtype = model[0].weight.grad.dtype
    if comm.rank == bad_rank:  # after the all-reduce: only this rank's gradient overflowed
        model[2].weight.grad[0, 0] = float("inf")
    found_inf = scaler.unscale_(opt)  # what step() below decides on (computed once)
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    with autocast("cpu", "bf16"):  # a clean step goes through on every rank
        scaler.scale(F.mse_loss(ddp(x).float(), y)).backward()
    scaler.step(opt)
    scaler.update()
    moved = not all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
    return {"found_inf": found_inf, "unchanged": unchanged, "scale": scaler.scale_value,
            "moved": moved, "grad_dtype": grad_dtype, "skipped": scaler.skipped_steps,
            "params": [t.detach().clone() for t in model.parameters()]}


def test_every_rank_skips_when_one_rank_overflows(pools):
    results = pools(3).run(skip_on_one_rank, 1)
    for res in results:
        assert res["found_inf"] and res["unchanged"] and res["skipped"] == 1
        assert res["scale"] == 512.0  # backed off once, not grown by the clean step
        assert res["moved"] and res["grad_dtype"] == torch.float32
        for got, first in zip(res["params"], results[0]["params"]):
            assert torch.equal(got, first)
