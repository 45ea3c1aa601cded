"""Gradient compression on real ranks: accuracy of the averaged gradient, the exact bytes the
transport counted, and training that still converges with top-k and PowerSGD.

Collectives use the ``ring`` algorithm here: its messages go through disttrain's transport,
so every byte is counted (``native`` hands them to torch.distributed, unseen). Summed over
ranks, a ring all-reduce of V bytes sends exactly 2(p−1)·V and a ring all-gather of k
bytes per rank exactly p(p−1)·k, which is what the byte assertions check.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.comm import Communicator
from disttrain.parallel import (
    Bucket,
    CastCompressor,
    DataParallel,
    PowerSGDCompressor,
    TopKCompressor,
    make_compressor,
)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))


def one_backward(comm: Communicator, compression: Any) -> dict[str, Any]:
    """Averaged gradients of one backward, and the bytes this rank sent for them."""
    model = make_model()
    ddp = DataParallel(model, comm, compression=compression, algorithm="ring")
    gen = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(16, 20, generator=gen), torch.randint(0, 10, (16,), generator=gen)
    before = comm.stats.bytes_sent
    F.cross_entropy(ddp(x), y).backward()
    return {"grads": [p.grad.clone() for p in model.parameters()],
            "bytes": comm.stats.bytes_sent - before}


def compare_casts(comm: Communicator) -> dict[str, Any]:
    return {name: one_backward(comm, name) for name in ("none", "fp16", "bf16")}


def test_16_bit_compression_halves_the_bytes_and_keeps_the_gradient(pools):
    p = 3
    results = pools(p).run(compare_casts)
    numel = sum(q.numel() for q in make_model().parameters())
    sent = {name: sum(res[name]["bytes"] for res in results) for name in results[0]}
    assert sent["none"] == 2 * (p - 1) * numel * 4  # ring all-reduce of fp32, exactly
    assert sent["fp16"] == sent["bf16"] == sent["none"] // 2
    for res in results:
        for name, rtol in (("fp16", 2e-3), ("bf16", 2e-2)):
            for got, exact in zip(res[name]["grads"], res["none"]["grads"]):
                atol = rtol * float(exact.abs().max())
                torch.testing.assert_close(got, exact, rtol=rtol, atol=atol)
            assert any(not torch.equal(g, e) for g, e in zip(res[name]["grads"],
                                                             res["none"]["grads"]))


def compare_sparse(comm: Communicator, ratio: float, rank: int) -> dict[str, Any]:
    return {"none": one_backward(comm, None)["bytes"],
            "topk": one_backward(comm, TopKCompressor(ratio))["bytes"],
            "powersgd": one_backward(comm, PowerSGDCompressor(rank))["bytes"]}


def test_topk_and_powersgd_bytes_match_their_formulas(pools):
    p, ratio, r = 2, 0.05, 2
    results = pools(p).run(compare_sparse, ratio, r)
    shapes = [q.shape for q in make_model().parameters()]
    numel = sum(s.numel() for s in shapes)  # one bucket: the model is far below 1 MiB
    k = math.ceil(ratio * numel)
    sent = {name: sum(res[name] for res in results) for name in results[0]}
    assert sent["none"] == 2 * (p - 1) * numel * 4
    assert sent["topk"] == p * (p - 1) * k * (4 + 4)  # fp32 values + int32 indices, gathered
    # PowerSGD: P (rows·r) and the biases in one all-reduce, Q (cols·r) in a second.
    p_q = sum((s[0] + s[1]) * r for s in shapes if len(s) == 2) + sum(
        s.numel() for s in shapes if len(s) == 1)
    assert sent["powersgd"] == 2 * (p - 1) * p_q * 4
    assert sent["topk"] < sent["none"] / 5 and sent["powersgd"] < sent["none"] / 4


# ---------------------------------------------------------------------- the mechanics
def rank_tensor(rank: int, step: int, n: int = 40) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(100 * step + rank))


def topk_mechanics(comm: Communicator) -> list[str]:
    """Two steps on a bare bucket; the expected average is rebuilt from every rank's input."""
    p, n, errors = comm.world_size, 40, []
    comp = TopKCompressor(0.1)
    k = comp.k_for(n)
    residuals = [torch.zeros(n) for _ in range(p)]
    for step in range(2):
        flat = rank_tensor(comm.rank, step)
        bucket = Bucket(0, [0], flat, [0], [flat.shape])
        comp.start(bucket, comm, "ring").wait()
        expected = torch.zeros(n)
        for r in range(p):
            acc = rank_tensor(r, step) + residuals[r]
            keep = acc.abs().topk(k).indices
            expected[keep] += acc[keep]
            residuals[r] = acc.clone()
            residuals[r][keep] = 0
        if not torch.allclose(flat, expected / p, atol=1e-6):
            errors.append(f"step {step}: average of the sent entries is wrong")
        if not torch.allclose(comp.residuals[0], residuals[comm.rank], atol=1e-6):
            errors.append(f"step {step}: residual is not what was left unsent")
    return errors


def powersgd_mechanics(comm: Communicator) -> list[str]:
    """One step: grad = P̂ P̂ᵀ mean(M), with P̂ = orth(mean(M) Q₀); bias sent exactly."""
    p, rows, cols, r = comm.world_size, 12, 9, 2
    comp = PowerSGDCompressor(r, seed=5)
    mats = [torch.randn(rows, cols, generator=torch.Generator().manual_seed(k)) for k in range(p)]
    biases = [torch.randn(rows, generator=torch.Generator().manual_seed(50 + k)) for k in range(p)]
    flat = torch.cat([mats[comm.rank].reshape(-1), biases[comm.rank]])
    bucket = Bucket(0, [0, 1], flat, [0, rows * cols], [torch.Size([rows, cols]),
                                                        torch.Size([rows])])
    q0 = comp._state(bucket).q_buf.view(cols, r).clone()
    comp.start(bucket, comm, "ring").wait()
    mean = sum(mats) / p
    p_hat = torch.linalg.qr(mean @ q0).Q
    expected = p_hat @ p_hat.t() @ mean
    errors = []
    if not torch.allclose(flat[: rows * cols].view(rows, cols), expected, atol=1e-5):
        errors.append("rank-r approximation of the mean is wrong")
    if not torch.allclose(flat[rows * cols :], sum(biases) / p, atol=1e-6):
        errors.append("uncompressed vector is not the plain average")
    error = comp.states[0].error
    assert error is not None
    if not torch.allclose(error[: rows * cols].view(rows, cols), mats[comm.rank] - expected,
                          atol=1e-5):
        errors.append("error feedback is not M − P Qᵀ")
    return errors


@pytest.mark.parametrize("check", [topk_mechanics, powersgd_mechanics])
def test_compressor_mechanics(pools, check):
    errors = [e for rank_errors in pools(3).run(check) for e in rank_errors]
    assert not errors, errors


# ---------------------------------------------------------------------- training
def least_squares(comm: Communicator, compression: str, steps: int) -> dict[str, Any]:
    """Fit W (8×16) to y = W* x from each rank's own rows; return the relative error."""
    gen = torch.Generator().manual_seed(0)
    w_star = torch.randn(8, 16, generator=gen)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1 + comm.rank))
    y = x @ w_star.t()
    torch.manual_seed(0)
    model = nn.Linear(16, 8, bias=False)
    compressor = make_compressor(compression, topk_ratio=0.1, powersgd_rank=2)
    ddp = DataParallel(model, comm, compression=compressor, algorithm="ring")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.3)
    for _ in range(steps):
        (ddp(x) - y).pow(2).sum(1).mean().mul(0.5).backward()  # Hessian XᵀX/n ≈ I
        opt.step()
        opt.zero_grad()
    err = float((model.weight.detach() - w_star).norm() / w_star.norm())
    return {"rel_error": err, "weight": model.weight.detach().clone()}


@pytest.mark.parametrize("compression", ["topk", "powersgd"])
def test_compressed_training_converges(pools, compression):
    results = pools(2).run(least_squares, compression, 120)
    assert results[0]["rel_error"] < 1e-3, results[0]["rel_error"]
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # replicas stay identical


def test_compressor_arguments_are_validated():
    with pytest.raises(ValueError, match="top-k ratio must be in"):
        TopKCompressor(0.0)
    with pytest.raises(ValueError, match="PowerSGD rank must be a positive int"):
        PowerSGDCompressor(0)
    with pytest.raises(ValueError, match=r"float16 or torch\.bfloat16"):
        CastCompressor(torch.float64)
    with pytest.raises(ValueError, match="unknown compression 'gzip'"):
        make_compressor("gzip")
    assert TopKCompressor(0.01).k_for(50) == 1 and TopKCompressor(0.5).k_for(7) == 4
