"""Tensor and sequence parallelism on real ranks train the TransformerLM to the same
parameters as one process (Adam, fp32), for tp = 2, 3 and 4, and in float64 with plain SGD
their gathered gradients equal one process's before any optimizer step (tp = 2, 3); the
conjugate operators move what they should; bad sizes are one-line errors naming the
dimension."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.parallel.tensor import (
    TPGroup,
    apply_tensor_parallel,
    full_state_dict,
)
from disttrain.parallel.tensor.layers import shard, unshard
from disttrain.train.transformer import TransformerLM
from tests.tensor_parallel_cases import (
    LR,
    batches,
    make_model,
    reference,
    user_model_by_plan,
    without_key_bias,
    worst_relative_error,
)

SGD_LR = 0.5  # large steps: a wrong gradient moves the parameters visibly


def train_tp(comm, sequence_parallel: bool) -> tuple[float, str, float, list[float]]:
    """Every rank of the pool is one TP rank; returns the worst relative error of the
    parameters and of the logits on a new batch against the reference, and the losses."""
    data = batches()
    trained = reference(data)
    model = apply_tensor_parallel(make_model(), comm, sequence_parallel, algorithm="ring")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = model.loss(model(x), y)
        loss.backward()
        model.reduce_sequence_parallel_grads()
        opt.step()
        losses.append(loss.item())
    err, name = worst_relative_error(full_state_dict(model, model.group), trained.state_dict())
    x, _ = batches(steps=1, seed=7)[0]
    with torch.no_grad():
        expected, logits = trained(x), model.full_logits(model(x))
    return err, name, float((logits - expected).norm() / expected.norm()), losses


@pytest.mark.parametrize("tp", [2, 3, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_tensor_parallel_equals_single_process(pools, tp, sequence_parallel):
    results = pools(tp).run(train_tp, sequence_parallel)
    for err, name, output_err, losses in results:
        assert err < 1e-5, (name, err)
        assert output_err < 1e-5
        assert losses == results[0][3]  # every TP rank computes the same loss


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient under its name (a clone)."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _full_grads(model, group) -> dict[str, torch.Tensor]:
    """The unsplit model's gradients on every rank: the parameters' data swapped for their
    gradients while :func:`full_state_dict` gathers them."""
    params = list(model.parameters())
    kept = [p.data for p in params]
    for p in params:
        p.data = p.grad
    try:
        return full_state_dict(model, model.group)
    finally:
        for p, data in zip(params, kept):
            p.data = data


def _relative_errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]
                     ) -> dict[str, float]:
    assert sorted(got) == sorted(want)
    got, want = without_key_bias(got), without_key_bias(want)
    return {k: float((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-300))
            for k in want}


def grads_and_sgd_tp(comm, sequence_parallel: bool) -> tuple[dict[str, float], dict[str, float]]:
    """float64, plain SGD: the relative error of every gathered gradient of the first step
    (before any optimizer) and of every parameter after the steps, against one process."""
    data = batches()
    full = make_model().double()
    ref_grads: dict[str, torch.Tensor] = {}
    opt = torch.optim.SGD(full.parameters(), lr=SGD_LR)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        F.cross_entropy(full(x).flatten(0, 1), y.flatten()).backward()
        if step == 0:
            ref_grads = _grads(full)
        opt.step()
    model = apply_tensor_parallel(make_model().double(), comm, sequence_parallel,
                                  algorithm="ring")
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    grad_err: dict[str, float] = {}
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        model.loss(model(x), y).backward()
        model.reduce_sequence_parallel_grads()
        if step == 0:
            grad_err = _relative_errors(_full_grads(model, model.group), ref_grads)
        opt.step()
    param_err = _relative_errors(full_state_dict(model, model.group), full.state_dict())
    return grad_err, param_err


@pytest.mark.parametrize("tp", [2, 3])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_tensor_parallel_gradients_and_sgd_equal_single_process_in_float64(
        pools, tp, sequence_parallel):
    """SGD moves each parameter by its gradient's scale: a gradient wrong by a factor (a
    missing or extra sum over the group) shows here by that factor, not through Adam's
    eps. Float64 leaves ~1e-15 for the different order of sums."""
    for grad_err, param_err in pools(tp).run(grads_and_sgd_tp, sequence_parallel):
        worst = max(grad_err, key=grad_err.__getitem__)
        assert grad_err[worst] < 1e-10, (worst, grad_err[worst])
        worst = max(param_err, key=param_err.__getitem__)
        assert param_err[worst] < 1e-10, (worst, param_err[worst])


@pytest.mark.parametrize("tp", [2, 3])
def test_a_users_model_by_plan_equals_one_process(pools, tp):
    """Any model, by a plan of module names (docs/tensor_parallel.md's example): a
    residual MLP's blocks split column then row, its head left whole."""
    for err in pools(tp).run(user_model_by_plan):
        assert err < 1e-12, err


# ---------------------------------------------------------------- pure pieces
@pytest.mark.parametrize("how", ["rows", "cols", "qkv"])
@pytest.mark.parametrize("t", [1, 2, 3])
def test_shards_join_back(how, t):
    full = torch.randn(3 * 12, 6)
    shards = torch.stack([shard(full, how, r, t) for r in range(t)])
    assert torch.equal(unshard(shards, how), full)


def test_qkv_shard_takes_each_ranks_heads_of_q_k_and_v():
    full = torch.arange(12.0).repeat_interleave(2).view(12, 2)  # rows: q0..q3 k0..k3 v0..v3
    rank1 = shard(full, "qkv", 1, 2)[:, 0].tolist()
    assert rank1 == [2.0, 3.0, 6.0, 7.0, 10.0, 11.0]


class _OneRank:
    """Just enough of a communicator to build the shard (no collective is called)."""

    rank, world_size = 0, 1


@pytest.mark.parametrize(("kwargs", "tp", "name"), [
    ({"n_heads": 4}, 3, "n_heads=4"),
    ({"vocab_size": 50}, 4, "vocab_size=50"),
    ({"vocab_size": 48, "n_heads": 6, "d_model": 30}, 4, "n_heads=6"),
])
def test_sizes_that_do_not_divide_name_the_dimension(kwargs, tp, name):
    args = {"vocab_size": 48, "max_len": 8, "d_model": 24, "n_heads": 4, **kwargs}
    comm = _OneRank()
    comm.world_size = tp
    with pytest.raises(ValueError) as info:
        apply_tensor_parallel(TransformerLM(**args), comm)  # type: ignore[arg-type]
    message = str(info.value)
    assert name in message and f"over {tp} ranks" in message and "\n" not in message


def test_only_the_transformer_is_split():
    with pytest.raises(ValueError, match="use --model transformer"):
        apply_tensor_parallel(torch.nn.Linear(2, 2), _OneRank())  # type: ignore[arg-type]


def test_group_needs_a_communicator():
    assert TPGroup.__dataclass_params__.frozen  # type: ignore[attr-defined]
