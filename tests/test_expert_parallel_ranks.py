"""Expert parallelism on real ranks equals the same MoE model on one process (float64): ep
over 2 ranks with 4 experts (top-1 and top-2, capacity binding), alone and inside dp (dp 2 ×
ep 2 on 4 ranks, DDP over dp), with plain SGD and Adam: the same tokens dropped, the same
logits, gradients and parameters after several steps, and the ep communicator's bytes equal
to the formula on every rank and every step. The reference reads the ranks' shards
concatenated, in rank order, as its batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.parallel.ddp import DataParallel
from disttrain.parallel.experts import (
    apply_expert_parallel,
    drain_traffic,
    expert_parameters,
    finish_gradients,
    full_state_dict,
    step_bytes,
)
from disttrain.parallel.mesh import MeshShape, build_mesh
from disttrain.train.moe import MoEConfig, TransformerMoE, add_aux_loss, routing_stats

STEPS, PER_RANK, VOCAB, LENGTH = 3, 2, 16, 8
LR = {"sgd": 0.5, "adam": 0.01}  # large SGD steps: a wrong gradient moves parameters visibly


def make_model(top_k: int) -> TransformerMoE:
    torch.manual_seed(0)
    moe = MoEConfig(n_experts=4, top_k=top_k, capacity_factor=1.0, aux_loss_coef=0.1)
    return TransformerMoE(VOCAB, LENGTH, d_model=16, n_heads=2, n_layers=2, moe=moe).double()


def batches(shards: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batches: ``shards`` × PER_RANK sequences each, shard i read by rank i."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, shards * PER_RANK, LENGTH + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def shard(batch: tuple[torch.Tensor, torch.Tensor], i: int) -> tuple[torch.Tensor, ...]:
    return tuple(t[i * PER_RANK:(i + 1) * PER_RANK] for t in batch)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[name])
    return torch.optim.Adam(model.parameters(), lr=LR[name])


def reference(top_k: int, opt_name: str, shards: int) -> dict[str, object]:
    """One process on the global batches: per step the logits, drops and gradients, and
    the parameters at the end."""
    model = make_model(top_k)
    opt, loss_fn = optimizer(opt_name, model), add_aux_loss(cross_entropy, model)
    steps = []
    for x, y in batches(shards):
        opt.zero_grad()
        logits = model(x)
        loss_fn(logits, y).backward()
        stats = routing_stats(model)
        steps.append({"logits": logits.detach(), "dropped": [s.dropped for s in stats],
                      "kept": [s.kept_per_expert for s in stats],
                      "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
    return {"steps": steps, "state": model.state_dict()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(b.norm(), 1e-30))


def full_grads(model: torch.nn.Module, ep) -> dict[str, torch.Tensor]:
    """The unsplit model's gradients: parameters swapped for their gradients while
    :func:`full_state_dict` gathers the experts."""
    params = list(model.parameters())
    kept = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return {n: t.clone() for n, t in full_state_dict(model, ep).items()}
    finally:
        for p, data in zip(params, kept):
            p.data = data


def train_ep(comm, top_k: int, opt_name: str, dp: int) -> dict[str, object]:
    """This rank of a dp × ep mesh (ep = 2) trains on its shard; returns its errors
    against the reference, its drops and its measured and formula bytes per step."""
    mesh = build_mesh(comm, MeshShape(dp=dp, ep=2))
    ep, me = mesh.ep, mesh.coord(("dp", "ep"))  # the shard this rank reads
    expected = reference(top_k, opt_name, comm.world_size)
    module = apply_expert_parallel(make_model(top_k), ep, algorithm="naive")
    model = DataParallel(module, mesh.dp, algorithm="ring") if mesh.dp else module
    opt, loss_fn = optimizer(opt_name, module), add_aux_loss(cross_entropy, module)
    assert len(expert_parameters(module)) == 2 * 2 * 4  # 2 layers × 2 experts × (w, b) × 2
    errors: dict[str, float] = {}
    dropped, kept, sent, formula = [], [], [], []
    for step, batch in enumerate(batches(comm.world_size)):
        x, y = shard(batch, me)
        ref = expected["steps"][step]  # type: ignore[index]
        opt.zero_grad()
        before = ep.stats.bytes_sent
        logits = model(x)
        loss_fn(logits, y).backward()
        finish_gradients(module, ep, algorithm="ring")
        sent.append(ep.stats.bytes_sent - before)
        formula.append(step_bytes(module, drain_traffic(module), ep.rank))
        stats = routing_stats(module)
        dropped.append([s.dropped for s in stats])
        kept.append([s.kept_per_expert for s in stats])
        errors[f"logits {step}"] = relative(logits.detach(), shard((ref["logits"],), me)[0])
        for name, grad in full_grads(module, ep).items():
            errors[f"grad {step} {name}"] = relative(grad, ref["grads"][name])
        opt.step()
    for name, value in full_state_dict(module, ep).items():
        errors[f"param {name}"] = relative(value, expected["state"][name])  # type: ignore
    worst = max(errors, key=errors.__getitem__)
    return {"worst": (worst, errors[worst]), "dropped": dropped, "kept": kept,
            "sent": sent, "formula": formula, "reference": [
                (s["dropped"], s["kept"]) for s in expected["steps"]]}  # type: ignore


def _check(results: list[dict[str, object]]) -> None:
    for r in results:
        name, err = r["worst"]  # type: ignore[misc]
        assert err < 1e-9, (name, err)
        assert r["sent"] == r["formula"] and min(r["sent"]) > 0  # type: ignore[type-var]
    for step, (dropped, kept) in enumerate(results[0]["reference"]):  # type: ignore
        assert sum(dropped) > 0  # the capacity binds, so the drops are compared
        assert [sum(r["dropped"][step][layer] for r in results)  # type: ignore[index]
                for layer in range(len(dropped))] == dropped
        assert [tuple(map(sum, zip(*(r["kept"][step][layer] for r in results))))  # type: ignore
                for layer in range(len(kept))] == [tuple(k) for k in kept]


@pytest.mark.nccl_rules
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_ep_equals_one_process(pools, top_k, opt_name):
    """ep = 2, 4 experts (2 per rank): same drops, logits, gradients, parameters."""
    _check(pools(2).run(train_ep, top_k, opt_name, 1))


@pytest.mark.nccl_rules
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_ep_inside_dp_equals_one_process(pools, opt_name):
    """dp 2 × ep 2 on 4 ranks, DDP over dp: each rank its own shard of the global batch."""
    _check(pools(4).run(train_ep, 2, opt_name, 2))


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def dispatch_edges(comm) -> list[float]:
    """Rank 0 keeps rows for experts 0 and 1 only, rank 1 sends one row to expert 0 and
    none of its own (its experts 2 and 3 get nothing), then a round where rank 1 has no rows
    at all: outputs and gradients equal the local experts' (an expert works row by row, so
    each rank's rows through all four experts on one process are the reference)."""
    from disttrain.parallel.experts import ExpertParallelExperts, Experts
    from disttrain.parallel.experts.ops import EPGroup

    torch.manual_seed(0)
    full = Experts.build(4, 4, 8).double()
    local = ExpertParallelExperts.from_experts(full, EPGroup(comm, "naive"))
    reference = dict(full.named_parameters())
    errors = []
    for counts in ([[3, 2, 0, 0], [1, 0, 0, 0]], [[1, 1, 0, 2], [0, 0, 0, 0]]):
        g = torch.Generator().manual_seed(sum(map(sum, counts)))
        rows = [torch.randn(sum(c), 4, dtype=torch.float64, generator=g) for c in counts]
        mine = rows[comm.rank].clone().requires_grad_()
        out = local(mine, counts[comm.rank])
        out.pow(2).sum().backward()
        full.zero_grad()
        inputs = [r.clone().requires_grad_() for r in rows]
        expected = [full(x, c) for x, c in zip(inputs, counts)]
        sum(e.pow(2).sum() for e in expected).backward()
        errors += [_gap(out, expected[comm.rank]), _gap(mine.grad, inputs[comm.rank].grad)]
        for name, p in local.named_parameters():
            assert p.grad is not None  # every expert ran, on no rows too: zeros, not None
            errors.append(_gap(p.grad, reference[name].grad))
            p.grad = None
        with torch.no_grad():
            errors.append(_gap(local(rows[comm.rank], counts[comm.rank]), out))
    return errors


@pytest.mark.nccl_rules
def test_dispatch_with_idle_experts_and_an_empty_rank(pools):
    for errors in pools(2).run(dispatch_edges):
        assert max(errors) < 1e-12
