"""Tensor and sequence parallelism on real ranks train the TransformerLM to the same
parameters as one process (Adam, fp32), for tp = 2, 3 and 4; the conjugate operators move
what they should; bad sizes are one-line errors naming the dimension."""

from __future__ import annotations

import pytest
import torch

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
    worst_relative_error,
)


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
